"""The machine's ceiling on the same threads: fp32 GEMM GFLOP/s and memory read bandwidth.

Decode at batch 1 streams every weight once per token, so it is bound by memory
bandwidth; batch-32 decode does 32 rows per weight read and approaches the GEMM ceiling.
Measuring both in the same run turns tokens/s into "what fraction of the machine we use".
Both figures are the best of a few repetitions, so they are ceilings, not averages.
"""

from __future__ import annotations

import time
from typing import Any


def _best_seconds(fn: Any, reps: int) -> float:
    fn()  # warm-up: page in, spin up the thread pool
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_gflops(n: int, threads: int, reps: int) -> dict[str, float]:
    """2n³ FLOP per n×n fp32 matmul, with torch (MKL/oneDNN) and numpy (its own BLAS)."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    out: dict[str, float] = {}
    out["torch"] = 2 * n**3 / _best_seconds(lambda: torch.mm(a, b), reps) / 1e9
    an, bn = a.numpy(), b.numpy()
    out["numpy"] = 2 * n**3 / _best_seconds(lambda: an @ bn, reps) / 1e9
    return out


def read_bandwidth_gbs(megabytes: int, threads: int, reps: int) -> dict[str, float]:
    """Bytes read per second summing a large fp32 array (torch uses the threads; numpy one)."""
    import numpy as np
    import torch

    torch.set_num_threads(threads)
    n = megabytes * 1024 * 1024 // 4
    t = torch.ones(n)
    nbytes = n * 4
    out: dict[str, float] = {}
    out["torch_sum"] = nbytes / _best_seconds(lambda: t.sum(), reps) / 1e9
    arr = t.numpy()
    out["numpy_sum"] = nbytes / _best_seconds(lambda: np.add.reduce(arr), reps) / 1e9
    return out


def read_bandwidth(threads: int, gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s of summing a resident ``gib`` GiB uint64 array split over ``threads`` Python
    threads (numpy releases the GIL): the bound the kernel benchmarks (gguf-matmul-speed,
    attention-speed, sized-speed) print their figures against, measured as they run."""
    import threading

    import numpy as np

    data = np.ones(int(gib * (1 << 30)) // 8, dtype=np.uint64)  # touched: every page resident
    parts = np.array_split(data, threads)
    best = float("inf")
    for _ in range(repeats):
        workers = [threading.Thread(target=np.add.reduce, args=(part,)) for part in parts]
        started = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        best = min(best, time.perf_counter() - started)
    return data.nbytes / best


def measure_ceiling(threads: int, quick: bool) -> dict[str, Any]:
    """Run in a worker whose BLAS thread pools were limited before numpy was imported."""
    n = 1024 if quick else 2048
    mb = 256 if quick else 1024
    reps = 2 if quick else 5
    gemm = gemm_gflops(n, threads, reps)
    bw = read_bandwidth_gbs(mb, threads, reps)
    return {
        "threads": threads,
        "gemm_n": n,
        "gemm_gflops": gemm,
        "gemm_gflops_best": max(gemm.values()),
        "bandwidth_array_mb": mb,
        "read_bandwidth_gbs": bw,
        "read_bandwidth_gbs_best": max(bw.values()),
    }
