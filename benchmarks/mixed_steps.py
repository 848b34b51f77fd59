"""Mixed steps measured: a prompt chunk riding in the decode step's pass vs a pass of its
own, and what the second group of rows costs a plain step. Prints figures; asserts nothing.

Usage:
    python -m benchmarks.mixed_steps --ckpt checkpoints/smollm2-135m-instruct \
        [--quantize gguf|int8|int4] [--threads 2] [--rounds 8] [--work DIR]

Builds engine.onnx of the checkpoint twice into ``--work``, with one group of rows (as
exported before mixed steps) and with two, sharing one weights.bin (``--quantize``
rewrites both the way ``attnserve export`` does), and runs each through the service's
EngineGraphRunner:

- decode steps at batch 1, 8 and 32, one graph then the other, ``--rounds`` times
  (median of each round's median);
- 8 rows decoding (150 cached tokens each) with a chunk of c tokens of a ninth row
  (500 cached) riding in the step, against the step alone plus the chunk's own pass.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

CHUNKS = (1, 4, 8, 16, 32, 64)
BATCHES = (1, 8, 32)


def build(ckpt: Path, work: Path, quantize: str | None) -> None:
    """one.onnx and two.onnx (+ weights.bin, config.json) in ``work``, unless there."""
    if (work / "two.onnx").is_file():
        return
    import json

    import onnx

    from export.engine_graph import build_engine_graph
    from export.onnx_build import save_graphs
    from export.quantize import quantize_weights
    from export.to_onnx import artifact_config, load_source
    from service.contract import io_spec as io

    loaded, tok = load_source(ckpt)
    gpt = loaded.model.eval()
    graphs = {}
    for name, mixed in (("one.onnx", False), ("two.onnx", True)):
        graph = build_engine_graph(gpt, matmul_only=quantize is not None, mixed=mixed)
        if quantize is not None:
            with tempfile.TemporaryDirectory() as tmp:
                src, dst = Path(tmp) / "fp32.onnx", Path(tmp) / "q.onnx"
                onnx.save_model(graph, str(src), save_as_external_data=True,
                                location="fp32.data")
                quantize_weights(src, dst, quantize, loaded.meta.training)
                graph = onnx.load(str(dst))
        graphs[name] = graph
    work.mkdir(parents=True, exist_ok=True)
    save_graphs(work, graphs)
    config = artifact_config(loaded, ckpt.name, "float32", tok)
    (work / io.CONFIG_FILE).write_text(json.dumps(config.to_dict()), "utf-8")


def median_ms(run: Callable[[], object], reset: Callable[[], None], reps: int) -> float:
    run()
    reset()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
        reset()
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--quantize", choices=["gguf", "int8", "int4"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--work", type=Path)
    args = parser.parse_args()
    work = args.work or Path(".cache/mixed-steps") / f"{args.ckpt.name}-{args.quantize or 'fp32'}"
    build(args.ckpt, work, args.quantize)

    from service.contract import io_spec as io
    from service.engine.engine_graph_runner import EngineGraphRunner
    from service.engine.runner import PoolConfig
    from service.providers import create_session

    config = io.ArtifactConfig.load(work)
    runners = {name: EngineGraphRunner(create_session(work / f"{name}.onnx", "cpu",
                                                      args.threads),
                                       config, PoolConfig(slots=48, max_len=1024))
               for name in ("one", "two")}
    assert runners["two"].mixes_chunks and not runners["one"].mixes_chunks
    rng = np.random.default_rng(0)
    rows, single, many, chunk_row = {}, {}, {}, {}
    for name, r in runners.items():
        single[name] = r.reserve(1)
        rows[name] = r.reserve(8)
        many[name] = r.reserve(32)
        r.prefill(single[name] + rows[name] + many[name],
                  [rng.integers(100, config.vocab_size, 150) for _ in range(41)])
        (chunk_row[name],) = r.reserve(1, top=True)
        r.extend_last(chunk_row[name], rng.integers(100, config.vocab_size, 500))

    def reset(name: str) -> Callable[[], None]:
        r = runners[name]

        def go() -> None:
            for s in single[name] + rows[name] + many[name]:
                r.truncate(s, 150)
            r.truncate(chunk_row[name], 500)
        return go

    steps: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for b in BATCHES:
            for name, r in runners.items():
                slots = {1: single, 8: rows, 32: many}[b][name]
                steps.setdefault((name, b), []).append(median_ms(
                    partial(r.decode, slots, np.full(b, 5)), reset(name), 20))
    print(f"{args.ckpt.name} {args.quantize or 'fp32'}, {args.threads} threads, "
          f"medians of {args.rounds} rounds")
    print("| decode step | one group (ms) | two groups, no chunk (ms) | two ÷ one |")
    print("|---|---|---|---|")
    for b in BATCHES:
        one, two = (statistics.median(steps[(n, b)]) for n in ("one", "two"))
        print(f"| batch {b} | {one:.2f} | {two:.2f} | {two / one:.3f} |")

    r = runners["two"]
    decode = median_ms(partial(r.decode, rows["two"], np.full(8, 5)), reset("two"), 15)
    print(f"\n8 rows decoding: {decode:.1f} ms a step")
    print("| chunk tokens | step with the chunk riding (ms) | step + the chunk's own pass (ms) |"
          " saved |")
    print("|---|---|---|---|")
    for c in CHUNKS:
        tokens = np.full(c, 7)
        riding = median_ms(partial(r.decode_with_chunk, rows["two"], np.full(8, 5),
                                   chunk_row["two"], tokens), reset("two"), 15)
        own = median_ms(partial(r.extend_last, chunk_row["two"], tokens), reset("two"), 15)
        print(f"| {c} | {riding:.1f} | {decode + own:.1f} | {decode + own - riding:.1f} ms |")


if __name__ == "__main__":
    main()
