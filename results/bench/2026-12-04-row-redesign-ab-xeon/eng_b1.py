"""One tree's engine at batch 1: decode tok/s (median of 8 calls) and the per-step time outside
ONNX Runtime's run (median). Usage: PYTHONPATH=TREE python eng_b1.py ART"""
import json, statistics, sys, time
from pathlib import Path
import numpy as np
import onnxruntime as ort
acc = {"t": 0.0, "n": 0}
orig = ort.InferenceSession.run_with_iobinding
def wrapped(self, *a, **k):
    t = time.perf_counter(); r = orig(self, *a, **k); acc["t"] += time.perf_counter() - t; acc["n"] += 1; return r
ort.InferenceSession.run_with_iobinding = wrapped
try:
    from benchmarks.lib.runner_engine import EngineRunner
except ImportError:
    from benchmarks.runner_engine import EngineRunner
r = EngineRunner(Path(sys.argv[1]), 2, max_len=512, max_batch_size=32)
rng = np.random.default_rng(0)
r.generate(rng.integers(3, 49000, (1, 64)).tolist(), 8)
tok, outside, ortms = [], [], []
for _ in range(8):
    acc["t"] = 0.0; acc["n"] = 0
    res = r.generate(rng.integers(3, 49000, (1, 64)).tolist(), 64)
    dec = res.total_s - res.ttft_s
    tok.append(63 / dec)
    outside.append((res.total_s - acc["t"]) / acc["n"] * 1e3)
    ortms.append(acc["t"] / acc["n"] * 1e3)
print(json.dumps({"tok_s": round(statistics.median(tok), 2), "outside_ms": round(statistics.median(outside), 3), "ort_ms": round(statistics.median(ortms), 3)}), flush=True)
import os; os._exit(0)
