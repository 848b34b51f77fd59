"""Offline ONNX Runtime graph optimisation, kept only when a measurement says it is faster.

ORT rewrites the graph (constant folding, redundant-node elimination, operator fusions)
and can save the result (``SessionOptions.optimized_model_filepath``). We use the
EXTENDED level, not ALL: ALL adds layout transformations tied to the machine that ran
them, while the artifact must load on any CPU (and on the CUDA execution provider).

Both graphs are timed on the same decode step (batch 1, a cache of half the context),
interleaved so that load from other processes hits both alike; the optimised graph
replaces model.onnx only when its median is lower and it still passes verification.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from export.verify import TorchReference, verify_decoder
from model.gpt import GPT
from service.contract import io_spec as io
from service.contract.reference import np_kv_dtype
from service.contract.sessions import Optimization, create_session

LEVEL: Optimization = "extended"
Check = Callable[[Path], dict[str, Any]]


def write_optimized(src: Path, dst: Path) -> Path:
    create_session(src, optimization=LEVEL, save_optimized_to=dst)
    return dst


def decode_step_feed(gpt: GPT, kv_dtype: io.KvDtype, batch: int = 1,
                     past_len: int | None = None) -> dict[str, np.ndarray]:
    """One decode step's inputs: a single new token after ``past_len`` cached ones."""
    cfg = gpt.config
    past_len = cfg.max_seq_len // 2 if past_len is None else past_len
    rng = np.random.default_rng(0)
    feed = {
        io.INPUT_IDS: rng.integers(3, cfg.vocab_size, (batch, 1)).astype(np.int64),
        io.ATTENTION_MASK: np.ones((batch, past_len + 1), np.int64),
        io.POSITION_IDS: np.full((batch, 1), past_len, np.int64),
    }
    shape = (batch, cfg.kv_heads, past_len, cfg.head_dim)  # (B, nkv, T_past, hs)
    for name in io.past_names(cfg.n_layers):
        feed[name] = rng.standard_normal(shape).astype(np_kv_dtype(kv_dtype))
    return feed


def median_latencies(paths: list[Path], feed: dict[str, np.ndarray], runs: int = 40,
                     warmup: int = 5) -> list[float]:
    """Median seconds per call of each graph, runs interleaved across graphs."""
    sessions = [create_session(p, threads=0) for p in paths]
    times: list[list[float]] = [[] for _ in paths]
    for i in range(warmup + runs):
        for sess, bucket in zip(sessions, times, strict=True):
            start = time.perf_counter()
            sess.run(None, feed)
            if i >= warmup:
                bucket.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def optimize_decoder(gpt: GPT, model_path: Path, kv_dtype: io.KvDtype = "float32",
                     check: Check | None = None, runs: int = 40) -> dict[str, Any]:
    """Optimise model.onnx in place if that makes the decode step faster; return the figures.

    ``check(path)`` must raise if the optimised graph is wrong and return its figures;
    it runs only when the optimised graph is about to be kept.
    """
    candidate = model_path.with_name(f".{model_path.stem}.optimized.onnx")
    try:
        write_optimized(model_path, candidate)
        feed = decode_step_feed(gpt, kv_dtype)
        base, optimized = median_latencies([model_path, candidate], feed, runs=runs)
        figures: dict[str, Any] = {
            "level": "ORT_ENABLE_EXTENDED",
            "measured": "median decode-step latency, batch 1, "
                        f"past {feed[io.ATTENTION_MASK].shape[1] - 1}, {runs} runs",
            "baseline_ms": round(base * 1e3, 4),
            "optimized_ms": round(optimized * 1e3, 4),
        }
        keep = optimized < base
        if keep and check is not None:
            try:
                figures["verification"] = check(candidate)
            except ValueError as exc:  # faster but not good enough: keep the original graph
                figures["verification_failed"] = str(exc)
                keep = False
        if keep:
            os.replace(candidate, model_path)
        figures["kept"] = keep
        figures["decision"] = (f"{'kept' if keep else 'discarded'} optimised graph "
                               f"({figures['optimized_ms']} ms vs {figures['baseline_ms']} ms "
                               "per decode step)")
        return figures
    finally:
        candidate.unlink(missing_ok=True)


def fp_check(gpt: GPT, kv_dtype: io.KvDtype, reference: TorchReference | None = None) -> Check:
    """The optimised graph must pass the same decoder checks against PyTorch (the same
    sequences: with the ``reference`` of the first verification, PyTorch runs no more)."""

    def check(path: Path) -> dict[str, Any]:
        figures = verify_decoder(gpt, path, kv_dtype, reference=reference)
        return {name: figures[name]["max_abs_diff"] for name in figures}

    return check
