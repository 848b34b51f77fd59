"""Where a decode step's time goes: ONNX Runtime's own profiler on the engine.

Usage (from the repository root, in the dev venv):
    python -m benchmarks step-profile --artifact artifacts/smollm2-135m-instruct \\
        [--batch 1] [--prompt 64] [--new 128] [--threads 2]

The engine runs as ``benchmarks.sized_speed`` runs it (``benchmarks/lib/runner_engine.py``: one
static batch of random prompts, greedy) with profiling switched on in every session it
creates; the profiles are then summed per node. Printed: the median time of each node over
the steps it ran in (so a decode step's cost, the prompt's pass counted once among ~NEW
steps), totalled per op type, and the largest nodes. The profiler adds a cost per node, so
its step is slower than ``sized_speed``'s: compare shares and ops, not tok/s. Use it to say
what bounds a step (bytes over the measured bandwidth, or per-node costs), not to time it.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.lib.measure import add_threads_option


def node_medians(profiles: list[Path]) -> dict[str, tuple[str, float]]:
    """node name → (op type, median microseconds of its kernel over its runs)."""
    runs: dict[str, list[float]] = collections.defaultdict(list)
    ops: dict[str, str] = {}
    for path in profiles:
        for event in json.loads(path.read_text("utf-8")):
            name = str(event.get("name", ""))
            if event.get("cat") != "Node" or not name.endswith("_kernel_time"):
                continue
            node = name.removesuffix("_kernel_time")
            runs[node].append(float(event["dur"]))
            ops[node] = str(event["args"]["op_name"])
    return {node: (ops[node], statistics.median(times)) for node, times in runs.items()}


def by_op(medians: dict[str, tuple[str, float]]) -> list[tuple[str, float, int]]:
    """(op type, summed median microseconds, nodes), largest first."""
    total: dict[str, float] = collections.defaultdict(float)
    nodes: collections.Counter[str] = collections.Counter()
    for op, micros in medians.values():
        total[op] += micros
        nodes[op] += 1
    return [(op, total[op], nodes[op]) for op in sorted(total, key=lambda o: -total[o])]


def profile_engine(artifact: Path, threads: int, batch: int, prompt: int, new: int,
                   prefix: str) -> tuple[Any, list[Path]]:
    """Run the engine with every session profiled; (its speeds, the profile files)."""
    import onnxruntime as ort

    from benchmarks.lib.runner_engine import EngineRunner
    from benchmarks.sized_speed import ours_speeds
    from service.contract import io_spec as io

    plain = ort.SessionOptions

    class Profiled(plain):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.enable_profiling = True
            self.profile_file_prefix = prefix

    ort.SessionOptions = Profiled  # the engine's sessions are made inside, by name
    try:
        runner = EngineRunner(artifact, threads, max_len=prompt + new + 8)
        try:
            speeds = ours_speeds(runner, io.ArtifactConfig.load(artifact).vocab_size, batch,
                                 prompt, new, seed=0)
            files = [Path(s.end_profiling()) for s in gc.get_objects()
                     if isinstance(s, ort.InferenceSession)]
        finally:
            runner.close()
    finally:
        ort.SessionOptions = plain
    return speeds, [f for f in files if f.is_file()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks step-profile",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", type=Path, required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--largest", type=int, default=6, help="nodes listed (6)")
    add_threads_option(p)
    args = p.parse_args(argv)
    if not (args.artifact / "manifest.json").is_file():
        print(f"step_profile: {args.artifact} holds no manifest.json", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="step-profile-") as work:
        speeds, files = profile_engine(args.artifact, args.threads, args.batch, args.prompt,
                                       args.new, str(Path(work) / "profile"))
        medians = node_medians(files)
    total = sum(micros for _, micros in medians.values())
    print(f"{args.artifact.name}: batch {args.batch}, decode {speeds.decode:.1f} tok/s under the "
          f"profiler; a step's kernels (sum of per-node medians) {total / 1e3:.2f} ms")
    for op, micros, nodes in by_op(medians):
        print(f"  {op:34s} {micros / 1e3:7.3f} ms {100 * micros / total:4.0f}%  {nodes} nodes")
    print("largest nodes:")
    for node, (op, micros) in sorted(medians.items(), key=lambda kv: -kv[1][1])[:args.largest]:
        print(f"  {node[:56]:56s} {op:22s} {micros / 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
