"""MatMulNBits settings side by side: perplexity and decode-step time of one artifact's
model.onnx quantised each way (how --quantize int4's block 32, asymmetric, accuracy
level 4 was chosen; export/quantize.py).

Usage:
    python -m benchmarks.quant_blocks --artifact artifacts/smollm2-135m-instruct \
        [--max-tokens 1024] [--threads 2] [--out /tmp/quant-blocks]

For every variant (float32, int8 block 32, int4 at blocks 16/32/64/128, symmetric or with
a zero point, accuracy level 0 = float activations or 4 = int8 activations) it writes a
quantised copy of model.onnx beside the artifact's config and tokenizer, scores
``--max-tokens`` of the stdlib corpus with export/evaluate.py (window 512, stride 256) and
times one decode step (a 64-token past) at batch 1 and 8: median of 15 runs after 3 warm-up
runs. Prints one line per variant. The LM head of an fp32 artifact is a Gemm, which the
quantiser leaves float32 here; an artifact exported with --quantize quantises it too.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import time
from pathlib import Path

import numpy as np

VARIANTS: list[tuple[str, int | None, int, int, bool]] = [  # name, bits, block, level, sym
    ("fp32", None, 0, 0, True), ("int8-b32-a4", 8, 32, 4, True),
    *[(f"int4-b{b}-a{a}{'' if s else '-asym'}", 4, b, a, s)
      for b in (16, 32, 64, 128) for a in (0, 4) for s in (True, False)],
]


def step_ms(path: Path, artifact: Path, batch: int, threads: int, past: int = 64) -> float:
    from service.contract import io_spec as io
    from service.contract.sessions import create_session

    session = create_session(path, threads=threads)
    cfg = io.ArtifactConfig.load(artifact)
    rng = np.random.default_rng(0)
    feed: dict[str, np.ndarray] = {io.INPUT_IDS: np.full((batch, 1), 100, np.int64),
            io.ATTENTION_MASK: np.ones((batch, past + 1), np.int64),
            io.POSITION_IDS: np.full((batch, 1), past, np.int64)}
    for name in io.past_names(cfg.n_layers):  # (B, nkv, past, hs)
        feed[name] = rng.standard_normal((batch, cfg.kv_heads, past, cfg.head_dim),
                                         dtype=np.float32)
    times = []
    for i in range(18):
        started = time.perf_counter()
        session.run([io.LOGITS], feed)
        if i >= 3:
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def write_variant(artifact: Path, out: Path, bits: int | None, block: int, level: int,
                  symmetric: bool) -> None:
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(artifact / name, out / name)
    model = onnx.load(str(artifact / "model.onnx"))  # external weights read in
    if bits is not None:
        quantizer = MatMulNBitsQuantizer(model, algo_config=DefaultWeightOnlyQuantConfig(
            block_size=block, is_symmetric=symmetric, accuracy_level=level, bits=bits))
        quantizer.process()
        model = quantizer.model.model
    onnx.save_model(model, str(out / "model.onnx"))


def main() -> None:
    from export.evaluate import artifact_backend, evaluate, load_text

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("/tmp/quant-blocks"))
    args = parser.parse_args()
    for logger in ("", "onnxruntime.quantization.matmul_nbits_quantizer"):
        logging.getLogger(logger).setLevel(logging.ERROR)
    text, source = load_text("stdlib")
    for name, bits, block, level, symmetric in VARIANTS:
        out = args.out / name
        write_variant(args.artifact, out, bits, block, level, symmetric)
        ppl = evaluate(artifact_backend(str(out)), text, source, max_tokens=args.max_tokens,
                       threads=args.threads)["perplexity"]
        b1, b8 = (step_ms(out / "model.onnx", args.artifact, b, args.threads) for b in (1, 8))
        print(f"{name:18s} perplexity {ppl:8.4f}   step b1 {b1:6.2f} ms   b8 {b8:6.2f} ms",
              flush=True)
        shutil.rmtree(out)


if __name__ == "__main__":
    main()
