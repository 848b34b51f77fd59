"""One tree's engine (EngineRunner, no HTTP) on one artifact: decode tok/s at batch 1, 8, 32.
Usage: PYTHONPATH=TREE python eng_ab.py ART  → one JSON line {batch: decode tok/s}"""
import json, sys
from pathlib import Path
import numpy as np
try:
    from benchmarks.lib.runner_engine import EngineRunner
except ImportError:
    from benchmarks.runner_engine import EngineRunner
r = EngineRunner(Path(sys.argv[1]), 2, max_len=512, max_batch_size=32)
rng = np.random.default_rng(0)
out = {}
r.generate(rng.integers(3, 49000, (1, 64)).tolist(), 8)  # warm
for b in (1, 8, 32):
    vals = []
    for _ in range(2):
        res = r.generate(rng.integers(3, 49000, (b, 64)).tolist(), 64)
        vals.append(b * 63 / (res.total_s - res.ttft_s))
    out[b] = round(max(vals), 2)
print(json.dumps(out), flush=True)
import os; os._exit(0)
