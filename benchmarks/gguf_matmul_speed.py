"""GgufMatMul's speed beside ONNX Runtime's MatMulNBits and float32 MatMul, one product.

Usage (from the repository root, in the dev venv; builds the op first if need be):
    nice -n 15 python -m benchmarks gguf-matmul-speed           # W hot in cache
    nice -n 15 python -m benchmarks gguf-matmul-speed --cold    # W read from memory
    python -m benchmarks gguf-matmul-speed --sizes 4096 --batches 1,32 --types Q4_0 --json out.json
    # GgufMatMul's batched kernels beside its per-row vec_dot, all batched types:
    python -m benchmarks gguf-matmul-speed --cold --sizes 4096 --batches 1,2,8,32 \
        --types Q4_1,Q4_0,Q8_0,Q4_K,Q6_K,Q5_0,Q5_1,Q5_K --paths auto,vec_dot
    # one thread, its CPU time: what other load on a shared machine inflates least
    python -m benchmarks gguf-matmul-speed --cold --threads 1 --cpu-time ...

For each weight type (Q4_0, Q4_1, Q4_K, Q6_K, Q8_0; Q5_0, Q5_1, Q5_K on request), size
N = K (4096, 2048) and batch M (1, 8, 32), one-node graphs computing Y = X·Wᵀ (X float32
[M, K]) with W an initializer:

* ``gguf``: GgufMatMul (service/ops) over W's GGUF blocks, its own choice of kernels
  (``gguf:vec_dot`` etc. with ``--paths``: ATTNSERVE_GGUF_MATMUL_PATH for the session).
  The legacy types are quantised by the gguf package from Gaussian weights; the K-quants,
  which it cannot quantise, are random blocks (random codes, small fp16 scales): the speed
  does not depend on the values.
* ``nbits``: com.microsoft.MatMulNBits, 4-bit, block 32, symmetric, accuracy_level 4 (int8
  activations, as llama.cpp's), made by onnxruntime's MatMulNBitsQuantizer from W's
  dequantised values (one per size: the values do not change its speed either).
* ``f32``: MatMul against the dequantised float32 W.

Each runs on ONNX Runtime's CPU provider with ``--threads`` (2) intra-op threads: three
warm-up runs, then runs until 0.5 s or 50 runs (at least 5); the median is printed, with
the weight bandwidth it implies (bytes of the graph's initializers ÷ time) and that as a
fraction of the machine's read bandwidth, measured first: summing a 1 GiB array as uint64
in ``--threads`` threads (numpy releases the GIL; best of 5). At these sizes W (2-67 MB)
may fit in the last-level cache and stay there between runs (fractions over 100%);
``--cold`` reads a 256 MB buffer before every timed run (untimed), so W comes from memory
as in a model's decode step. (Several sessions taking turns would not do: each session
has its own pool, whose threads spin after a run and take the cores from the next.) On a
shared machine other load makes every figure noisy (a preempted pool thread shows as a
4-8 ms step): run under ``nice`` and compare within one run.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.lib.ceiling import read_bandwidth
from benchmarks.lib.measure import CacheFlush, median_seconds

TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q8_0")
# Accepted by --types too (GgufMatMul's batched kernels cover them).
MORE_TYPES = ("Q5_0", "Q5_1", "Q5_K")
# (block, block bytes, byte offsets of the fp16 scales in a block) for the random blocks.
RANDOM_BLOCKS = {"Q4_K": (256, 144, (0, 2)), "Q5_K": (256, 176, (0, 2)),
                 "Q6_K": (256, 210, (208,))}
NBITS_BLOCK = 32
NBITS_LEVEL = 4
# GgufMatMul's choice of kernels (service/ops/gguf_matmul.cc): auto, vec_dot, avx2, avx512vnni.
PATH_ENV = "ATTNSERVE_GGUF_MATMUL_PATH"


def gguf_weights(name: str, n: int, k: int, rng: np.random.Generator
                 ) -> tuple[int, np.ndarray, np.ndarray]:
    """(GGUF type id, W as stored (N, row_bytes) uint8, dequantised W (N, K) float32)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[name]
    if name in RANDOM_BLOCKS:
        block, block_bytes, halves = RANDOM_BLOCKS[name]
        raw = rng.integers(0, 256, size=(n, k // block, block_bytes), dtype=np.uint8)
        for offset in halves:
            scales = (rng.uniform(0.5, 1.5, size=raw.shape[:2]) * 2.0**-5).astype(np.float16)
            raw[..., offset:offset + 2] = scales.view(np.uint8).reshape(*raw.shape[:2], 2)
        stored = raw.reshape(n, -1)
    else:
        dense = rng.standard_normal((n, k), dtype=np.float32)
        stored = np.ascontiguousarray(quantize(dense, qtype)).view(np.uint8).reshape(n, -1)
    return qtype.value, stored, dequantize(stored, qtype).reshape(n, k).astype(np.float32)


def _model(nodes: list[Any], initializers: list[Any], opsets: dict[str, int]) -> Any:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        nodes, "product", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["M", None])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", None])],
        initializer=initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v)
                                                   for d, v in opsets.items()])


def gguf_model(type_id: int, stored: np.ndarray, k: int, activations: str = "int8",
               layout: str = "rows") -> Any:
    from onnx import helper, numpy_helper

    import service.ops

    node = helper.make_node(service.ops.MATMUL_OP, ["X", "W"], ["Y"], domain=service.ops.DOMAIN,
                            ggml_type=type_id, k=k, activations=activations, layout=layout)
    return _model([node], [numpy_helper.from_array(stored, "W")],
                  {"": 17, service.ops.DOMAIN: 1})


def float_model(dense: np.ndarray) -> Any:
    from onnx import helper, numpy_helper

    node = helper.make_node("MatMul", ["X", "Wt"], ["Y"])  # X (M, K) @ Wt (K, N)
    return _model([node], [numpy_helper.from_array(np.ascontiguousarray(dense.T), "Wt")],
                  {"": 17})


def nbits_model(dense: np.ndarray, level: int = NBITS_LEVEL) -> Any:
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    config = DefaultWeightOnlyQuantConfig(block_size=NBITS_BLOCK, is_symmetric=True,
                                          accuracy_level=level, bits=4)
    quantizer = MatMulNBitsQuantizer(float_model(dense), algo_config=config)
    quantizer.process()
    model = quantizer.model.model
    ops = [node.op_type for node in model.graph.node]
    if ops != ["MatMulNBits"]:
        raise RuntimeError(f"the quantiser left {ops}, not one MatMulNBits")
    return model


def weight_bytes(model: Any) -> int:
    from onnx import numpy_helper

    return sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer)


def session(model: Any, threads: int, path: str | None = None) -> Any:
    """A session on ``threads`` intra-op threads; ``path``: GgufMatMul's
    ATTNSERVE_GGUF_MATMUL_PATH while the session is created (read then)."""
    import os


    saved = os.environ.pop(PATH_ENV, None)
    if path is not None:
        os.environ[PATH_ENV] = path
    try:
        return _session(model, threads)
    finally:
        os.environ.pop(PATH_ENV, None)
        if saved is not None:
            os.environ[PATH_ENV] = saved


def _session(model: Any, threads: int) -> Any:
    import onnxruntime as ort

    import service.ops

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    if not service.ops.register(options):
        raise RuntimeError("the GgufMatMul library is not built (python -m service.ops.build)")
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def time_kernel(model: Any, kind: str, name: str, size: int, batches: list[int],
                threads: int, bandwidth: float, flush: CacheFlush | None,
                rng: np.random.Generator, path: str | None = None,
                clock: Callable[[], float] = time.perf_counter) -> list[dict[str, Any]]:
    """Median time per batch size (the cache flushed before each run with ``flush``)."""
    sess = session(model, threads, path)
    nbytes = weight_bytes(model)
    rows = []
    for m in batches:
        feed = {"X": rng.standard_normal((m, size), dtype=np.float32)}
        seconds = median_seconds(lambda: sess.run(None, feed), flush,  # noqa: B023 (called now)
                                 clock=clock)
        rows.append({"type": name, "size": size, "m": m, "kernel": kind, "weight_bytes": nbytes,
                     "cold": flush is not None, "ms": seconds * 1e3,
                     "gb_s": nbytes / seconds / 1e9, "of_bandwidth": nbytes / seconds / bandwidth})
    return rows


def kernel_name(path: str) -> str:
    return "gguf" if path == "auto" else f"gguf:{path}"


# --paths float: GgufMatMul at float activations (its "activations" attribute, not a path
# of the environment variable), beside MatMulNBits at accuracy level 0, ONNX Runtime's own
# float-activation kernel over 4-bit blocks.
FLOAT_PATH = "float"
# --paths repacked: GgufMatMul over W in ggml's repack layout (its "layout" attribute; the
# types ggml repacks here: Q4_0, IQ4_NL), computed by ggml's gemv / gemm.
REPACKED_PATH = "repacked"


def bench_size(size: int, types: list[str], batches: list[int], threads: int,
               bandwidth: float, flush: CacheFlush | None, rng: np.random.Generator,
               paths: tuple[str, ...] = ("auto",),
               clock: Callable[[], float] = time.perf_counter) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    baseline: list[dict[str, Any]] = []
    for name in types:
        type_id, stored, dense = gguf_weights(name, size, size, rng)
        for path in paths:
            if path == REPACKED_PATH:
                import service.ops

                layout, _ = service.ops.repack(type_id, size, stored)
                if layout is not None:
                    rows += time_kernel(gguf_model(type_id, layout, size,
                                                   layout=service.ops.REPACKED_LAYOUT),
                                        kernel_name(path), name, size, batches, threads,
                                        bandwidth, flush, rng, None, clock)
                continue
            floats = path == FLOAT_PATH
            rows += time_kernel(gguf_model(type_id, stored, size, "float" if floats else "int8"),
                                kernel_name(path), name, size, batches, threads, bandwidth,
                                flush, rng, None if floats else path, clock)
        if not baseline:  # MatMulNBits and f32 run alike whatever the values: timed once
            models = [("nbits", nbits_model(dense)), ("f32", float_model(dense))]
            if FLOAT_PATH in paths:
                models.insert(1, ("nbits:float", nbits_model(dense, level=0)))
            for kind, model in models:
                baseline += time_kernel(model, kind, name, size, batches, threads, bandwidth,
                                        flush, rng, clock=clock)
        rows += [dict(r, type=name) for r in baseline]
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    kinds = list(dict.fromkeys(r["kernel"] for r in rows))
    widths = {k: max(9, len(k) + 3) for k in kinds}
    header = "  ".join(f"{k + ' ms':>{widths[k]}} {'GB/s':>6} {'/bw':>4}" for k in kinds)
    for (name, size) in dict.fromkeys((r["type"], r["size"]) for r in rows):
        mine = [r for r in rows if r["type"] == name and r["size"] == size]
        sizes = {r["kernel"]: r["weight_bytes"] / 1e6 for r in mine}
        # The first GgufMatMul column this type has (--paths repacked alone: maybe none).
        gguf = next((f"{mb:.1f} MB" for kind, mb in sizes.items() if kind.startswith("gguf")),
                    "-")
        print(f"\n{name} N=K={size}  W: gguf {gguf}, nbits "
              f"{sizes['nbits']:.1f} MB, f32 {sizes['f32']:.1f} MB")
        print(f"{'M':>4}  {header}")
        for m in dict.fromkeys(r["m"] for r in mine):
            cells = []
            for kind in kinds:
                found = [r for r in mine if r["m"] == m and r["kernel"] == kind]
                if not found:  # a layout this type does not have
                    cells.append(f"{'-':>{widths[kind]}} {'':>6} {'':>4}")
                    continue
                (r,) = found
                cells.append(f"{r['ms']:{widths[kind]}.3f} {r['gb_s']:6.1f} "
                             f"{r['of_bandwidth']:4.0%}")
            print(f"{m:>4}  " + "  ".join(cells))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks gguf-matmul-speed",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="4096,2048", help="N = K values (default 4096,2048)")
    p.add_argument("--batches", default="1,8,32", help="M values (default 1,8,32)")
    p.add_argument("--types", default=",".join(TYPES),
                   help=f"default {','.join(TYPES)}; also {','.join(MORE_TYPES)}")
    p.add_argument("--paths", default="auto",
                   help="GgufMatMul kernels to time, each a column (ATTNSERVE_GGUF_MATMUL_PATH: "
                        "auto, vec_dot, avx2, avx512vnni; float: its float-activation path, "
                        "beside MatMulNBits at accuracy level 0; repacked: W in ggml's repack "
                        "layout, for the types it has; default auto)")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads (default 2)")
    p.add_argument("--cold", action="store_true",
                   help="flush the caches before every timed run (W read from memory)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time the calling thread's CPU time, not the wall clock (needs "
                        "--threads 1, where ONNX Runtime computes on the calling thread): "
                        "what other load on a shared machine does not inflate")
    p.add_argument("--json", type=Path, help="also write every figure here")
    args = p.parse_args(argv)
    if args.cpu_time and args.threads != 1:
        p.error("--cpu-time needs --threads 1")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    from service.ops import build

    try:
        build.ensure_built()
    except build.BuildError as exc:
        print(f"gguf_matmul_speed: the op library cannot be built: {exc}", file=sys.stderr)
        return 2
    bandwidth = read_bandwidth(args.threads)
    print(f"read bandwidth ({args.threads} threads, numpy sum of 1 GiB): "
          f"{bandwidth / 1e9:.1f} GB/s")
    rng = np.random.default_rng(0)
    flush = CacheFlush() if args.cold else None
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        rows += bench_size(size, args.types.split(","), [int(m) for m in args.batches.split(",")],
                           args.threads, bandwidth, flush, rng, tuple(args.paths.split(",")),
                           clock)
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps({"read_bandwidth": bandwidth, "threads": args.threads,
                                         "cold": args.cold, "cpu_time": args.cpu_time,
                                         "rows": rows}, indent=2) + "\n",
                             encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
