"""CachedAttention (service/ops) beside ONNX Runtime's GroupQueryAttention, one layer's call.

Usage (from the repository root, in the dev venv; builds the op first if need be):
    python -m benchmarks attention-speed                        # the shapes below, cache cold
    python -m benchmarks attention-speed --shapes llama-1b --batches 1,32 --context 160
    python -m benchmarks attention-speed --json out.json

For each model shape (query heads, key/value heads, head size: SmolLM2-135M 9/3/64, the 1B
and 3B Llama presets 32/8/64 and 24/8/128) and batch B, one-node graphs of either op over
the same inputs as the engine feeds them: B decode rows (S = 1) whose rows have
``--context`` cached tokens, rotary by halves, the KV cache (B, N_kv, ``--cache``, H) bound as
both past and present (one OrtValue each, updated in place), and a prompt chunk (B = 1,
S = ``--chunk``, a first prompt). Ours runs over a float32 cache and over a float16 one
(``f16 ms``: half the bytes; the rows-read figures are the float32 cache's). Each runs on
``--threads`` intra-op threads, with a 256 MB buffer read before every timed run so the
cache comes from memory as in a decode step (each layer's rows are read once a step): three
warm-up runs, then until 0.5 s or 50 runs; the median is printed, with the rows of K and V
the call reads ÷ its time, and that as a fraction of the machine's read bandwidth measured
first (gguf-matmul-speed's measure). The ops alternate shape by shape, so a busy machine
slows them alike.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.lib.ceiling import read_bandwidth
from benchmarks.lib.measure import CacheFlush, median_seconds

SHAPES = {"smollm2-135m": (9, 3, 64), "llama-1b": (32, 8, 64), "llama-3b": (24, 8, 128)}
# column → (op, domain (None: the library's), cache element type)
OPS = {"gqa": ("GroupQueryAttention", "com.microsoft", "float32"),
       "ours": ("CachedAttention", None, "float32"),
       "ours_f16": ("CachedAttention", None, "float16")}
INPUTS = ("query", "", "", "past_key", "past_value", "seqlens_k", "total_sequence_length",
          "cos_cache", "sin_cache")


def attention_model(op: str, domain: str, heads: int, kv_heads: int, rotary: str = "half",
                    window: int = -1, scale: float = 0.0, cache: str = "float32") -> bytes:
    """One GroupQueryAttention-shaped node (``op`` of ``domain``) with the engine's inputs:
    packed q | k | v, the cache (past and present of ``cache``'s type, float32 or float16),
    seqlens_k, total_sequence_length and, unless ``rotary`` is "none", the cos / sin tables
    ("half": by halves, "pairs": interleaved)."""
    from onnx import TensorProto, helper

    def type_of(name: str) -> int:
        if "seq" in name:
            return TensorProto.INT32
        if name.startswith(("past", "present")) and cache == "float16":
            return TensorProto.FLOAT16
        return TensorProto.FLOAT

    attrs: dict[str, Any] = {"num_heads": heads, "kv_num_heads": kv_heads, "scale": scale}
    if rotary != "none":
        attrs.update(do_rotary=1, rotary_interleaved=int(rotary == "pairs"))
    if window > 0:
        attrs["local_window_size"] = window
    inputs = INPUTS if rotary != "none" else INPUTS[:7]
    node = helper.make_node(op, list(inputs), ["output", "present_key", "present_value"],
                            domain=domain, name="attn", **attrs)
    graph = helper.make_graph(
        [node], op, [helper.make_tensor_value_info(n, type_of(n), None) for n in inputs if n],
        [helper.make_tensor_value_info(n, type_of(n), None)
         for n in ("output", "present_key", "present_value")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(domain, 1)])
    return model.SerializeToString()


def rotary_tables(positions: int, head_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions, H/2) cos and sin of θ_i = 10000^(−2i/H), as a Llama's."""
    half = head_size // 2
    angles = np.arange(positions)[:, None] * 10000.0 ** (-np.arange(half) / half)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def session(model: bytes, threads: int) -> Any:
    import onnxruntime as ort

    import service.ops

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    if not service.ops.register(options):
        raise RuntimeError("the op library is not built (python -m service.ops.build)")
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def time_call(op: str, shape: tuple[int, int, int], batch: int, tokens: int, context: int,
              cache: int, threads: int, flush: CacheFlush) -> float:
    """Median seconds of one call: ``batch`` rows of ``tokens`` new tokens after ``context``
    cached ones (a first prompt when context is 0), the cache bound in place."""
    import onnxruntime as ort

    import service.ops

    heads, kv_heads, hs = shape
    name, domain, element = OPS[op]
    sess = session(attention_model(name, domain or service.ops.DOMAIN, heads, kv_heads,
                                   cache=element), threads)
    rng = np.random.default_rng(0)
    width = (heads + 2 * kv_heads) * hs
    cos, sin = rotary_tables(cache + 1, hs)
    total = context + tokens
    binding = sess.io_binding()
    binding.bind_cpu_input("query", rng.standard_normal((batch, tokens, width), np.float32))
    binding.bind_cpu_input("seqlens_k", np.full(batch, total - 1, np.int32))
    binding.bind_cpu_input("total_sequence_length",
                           np.array([tokens if context == 0 else cache], np.int32))
    binding.bind_cpu_input("cos_cache", cos)
    binding.bind_cpu_input("sin_cache", sin)
    caches = []  # the bound cache OrtValues, kept alive for the session's runs
    for past, present in (("past_key", "present_key"), ("past_value", "present_value")):
        value = ort.OrtValue.ortvalue_from_numpy(
            rng.standard_normal((batch, kv_heads, cache, hs), np.float32).astype(element))
        caches.append(value)
        binding.bind_ortvalue_input(past, value)
        binding.bind_ortvalue_output(present, value)
    binding.bind_output("output")
    return median_seconds(lambda: sess.run_with_iobinding(binding), flush)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--context", type=int, default=160,
                        help="cached tokens a decode row attends to (a 64 → 128 run's middle)")
    parser.add_argument("--cache", type=int, default=512, help="positions the buffers hold")
    parser.add_argument("--chunk", type=int, default=256, help="a prompt chunk's tokens")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    if unknown := [s for s in shapes if s not in SHAPES]:
        parser.error(f"--shapes: unknown {', '.join(unknown)}; choose from {', '.join(SHAPES)}")
    batches = [int(b) for b in args.batches.split(",")]
    if args.context + 1 > args.cache or args.chunk > args.cache:
        parser.error("--cache must hold --context + 1 and --chunk positions")
    bandwidth = read_bandwidth(args.threads)
    print(f"read bandwidth ({args.threads} threads): {bandwidth / 1e9:.1f} GB/s")
    flush = CacheFlush()
    rows: list[dict[str, Any]] = []
    print(f"{'shape':<14}{'call':<16}{'gqa ms':>10}{'ours ms':>10}{'f16 ms':>10}"
          f"{'gqa/ours':>10}{'ours/f16':>10}{'ours GB/s':>11}{'of bound':>10}")
    for name in shapes:
        _, kv_heads, hs = SHAPES[name]
        calls = [(f"decode b{b}", b, 1, args.context) for b in batches]
        calls.append((f"prompt {args.chunk}", 1, args.chunk, 0))
        for label, batch, tokens, context in calls:
            seconds = {op: time_call(op, SHAPES[name], batch, tokens, context, args.cache,
                                     args.threads, flush) for op in OPS}
            # rows of K and V read: every cached and new position, once a key/value head
            read = 2 * batch * kv_heads * (context + tokens) * hs * 4
            speed = read / seconds["ours"]
            rows.append({"shape": name, "call": label, "batch": batch, "tokens": tokens,
                         "context": context, "gqa_ms": seconds["gqa"] * 1e3,
                         "ours_ms": seconds["ours"] * 1e3,
                         "ours_f16_ms": seconds["ours_f16"] * 1e3, "cache_bytes_read": read,
                         "ours_gbs": speed / 1e9, "of_bound": speed / bandwidth})
            print(f"{name:<14}{label:<16}{seconds['gqa'] * 1e3:>10.3f}"
                  f"{seconds['ours'] * 1e3:>10.3f}{seconds['ours_f16'] * 1e3:>10.3f}"
                  f"{seconds['gqa'] / seconds['ours']:>10.2f}"
                  f"{seconds['ours'] / seconds['ours_f16']:>10.2f}"
                  f"{speed / 1e9:>11.1f}{speed / bandwidth:>10.0%}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "context": args.context,
                                         "cache": args.cache, "read_bandwidth_gbs":
                                         bandwidth / 1e9, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
