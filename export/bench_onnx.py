"""Benchmark: ONNX Runtime vs PyTorch (with and without KV cache) on the same weights.

Usage:
    .venv/bin/python -m export.bench_onnx                       # small and base, batch 1/8/32
    .venv/bin/python -m export.bench_onnx --presets small --batches 1,8 --steps 16

For each preset a checkpoint with RANDOM-INIT weights (speed does not depend on training)
and a BPE tokenizer is written to a temp dir, exported with the full pipeline (export +
verification + optimisation; its wall time is printed), then timed at each batch size:
prefill latency of a --prompt-token prompt (median of --repeats), and decode tokens/s over
--steps greedy steps (ORT through the KV cache; PyTorch with the cache; PyTorch recomputing
the whole sequence each step). All three run in one process on the same weights.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from export import io_spec as io
from export.to_onnx import export_artifact
from model.checkpoint import CheckpointMeta, load_checkpoint, save_checkpoint
from model.config import config_from_preset
from model.gpt import GPT
from model.tokenizer import special_ids, train_bpe_tokenizer

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


def make_checkpoint(preset: str, root: Path) -> Path:
    text = CORPUS.read_text("utf-8") if CORPUS.is_file() else "hello world " * 5000
    tok = train_bpe_tokenizer([text[i:i + 4000] for i in range(0, len(text), 4000)], 4096)
    cfg = config_from_preset(preset, vocab_size=tok.get_vocab_size())
    torch.manual_seed(0)
    meta = CheckpointMeta(model=cfg, tokenizer={"kind": "bpe", **special_ids(tok).to_dict()})
    return save_checkpoint(root / f"{preset}-ckpt", GPT(cfg).eval(), meta, tok.to_str())


def median_time(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ort_runner(path: Path, gpt: GPT):  # type: ignore[no-untyped-def]
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    cfg = gpt.config

    def prefill(ids: np.ndarray) -> list[np.ndarray]:
        b, t = ids.shape
        feed = {io.INPUT_IDS: ids, io.ATTENTION_MASK: np.ones_like(ids),
                io.POSITION_IDS: np.tile(np.arange(t, dtype=np.int64), (b, 1))}
        feed.update({n: np.zeros((b, cfg.n_heads, 0, cfg.head_dim), np.float32)
                     for n in io.past_names(cfg.n_layers)})
        return sess.run(None, feed)

    def decode(ids: np.ndarray, steps: int) -> None:
        b, t = ids.shape
        logits, *present = prefill(ids)
        for step in range(steps):
            nxt = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
            feed = {io.INPUT_IDS: nxt, io.ATTENTION_MASK: np.ones((b, t + step + 1), np.int64),
                    io.POSITION_IDS: np.full((b, 1), t + step, np.int64)}
            feed.update(zip(io.past_names(cfg.n_layers), present, strict=True))
            logits, *present = sess.run(None, feed)

    return prefill, decode


@torch.no_grad()
def torch_decode(gpt: GPT, ids: torch.Tensor, steps: int, cache: bool) -> None:
    out = gpt(ids)
    seq = ids
    for _ in range(steps):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        seq = torch.cat([seq, nxt], dim=1)
        out = gpt(nxt, past_key_values=out.present) if cache else gpt(seq)


def time_batches(gpt: GPT, prefill, decode,  # type: ignore[no-untyped-def]
                 args: argparse.Namespace) -> None:
    print(f"{'batch':>5} {'ORT prefill ms':>15} {'torch prefill ms':>17} "
          f"{'ORT tok/s':>10} {'torch+KV tok/s':>15} {'torch noKV tok/s':>17}")
    for b in map(int, args.batches.split(",")):
        ids = np.random.default_rng(0).integers(3, gpt.config.vocab_size,
                                                (b, args.prompt)).astype(np.int64)
        tids = torch.from_numpy(ids)
        ort_pre = median_time(lambda ids=ids: prefill(ids), args.repeats)
        with torch.no_grad():
            pt_pre = median_time(lambda tids=tids: gpt(tids), args.repeats)
        n = b * args.steps
        ort_dec = median_time(lambda ids=ids: decode(ids, args.steps), 1)
        pt_kv = median_time(lambda t=tids: torch_decode(gpt, t, args.steps, True), 1)
        pt_no = median_time(lambda t=tids: torch_decode(gpt, t, args.steps, False), 1)
        print(f"{b:>5} {ort_pre * 1e3:>15.2f} {pt_pre * 1e3:>17.2f} {n / ort_dec:>10.0f} "
              f"{n / pt_kv:>15.0f} {n / pt_no:>17.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--presets", default="small,base")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--steps", type=int, default=32, help="decode steps")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(f"torch threads {torch.get_num_threads()}; weights random-init; prompt {args.prompt} "
          f"tokens; {args.steps} decode steps; median of {args.repeats}")
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets.split(","):
            ckpt = make_checkpoint(preset, Path(tmp))
            start = time.perf_counter()
            art = export_artifact(ckpt, Path(tmp) / f"{preset}-art")
            print(f"\n[{preset}] export (trace + verify + optimise) wall time "
                  f"{time.perf_counter() - start:.1f}s")
            gpt = load_checkpoint(ckpt).model
            time_batches(gpt, *ort_runner(art / io.MODEL_FILE, gpt), args)


if __name__ == "__main__":
    main()
