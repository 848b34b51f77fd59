"""GgufMatMul's batched kernels at M = 32 on the 1B preset's product shapes (gate | up, down,
and larger N), random blocks of each type: median ms of 15 runs and GMAC/s. Run from the
repository root: python results/bench/2026-12-05-zen5-f16-cache/batched_shapes.py Q4_K,Q6_K,Q4_0
(the weights warm in cache between runs: the arithmetic's rate, not the memory's)."""
import sys
import time

import numpy as np

sys.path.insert(0, ".")
from benchmarks.gguf_matmul_speed import gguf_model, gguf_weights, session

rng = np.random.default_rng(0)
M = 32
for name, n, k in [(t, n, k) for t in sys.argv[1].split(",") for (n, k) in
                   [(16384, 2048), (2048, 8192), (32768, 2048), (65536, 2048)]]:
    tid, stored, _ = gguf_weights(name, n, k, rng)
    sess = session(gguf_model(tid, stored, k), 2)
    x = rng.standard_normal((M, k), dtype=np.float32)
    for _ in range(3):
        sess.run(None, {"X": x})
    ts = []
    for _ in range(15):
        t = time.perf_counter()
        sess.run(None, {"X": x})
        ts.append(time.perf_counter() - t)
    s = float(np.median(ts))
    print(f"{name} N={n} K={k} M={M}: {s*1e3:.3f} ms  {M*n*k/s/1e9:.0f} GMAC/s", flush=True)
