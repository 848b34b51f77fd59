import sys, time
sys.path.insert(0, ".")
import onnxruntime as ort
from pathlib import Path
acc = {"t": 0.0, "n": 0}
orig = ort.InferenceSession.run_with_iobinding
def wrapped(self, *a, **k):
    t = time.perf_counter(); r = orig(self, *a, **k); acc["t"] += time.perf_counter() - t; acc["n"] += 1; return r
ort.InferenceSession.run_with_iobinding = wrapped
from benchmarks.lib.runner_engine import EngineRunner
r = EngineRunner(Path(sys.argv[2] if len(sys.argv) > 2 else "artifacts/smollm2-135m-instruct"), 2)
import numpy as np
rng = np.random.default_rng(0)
for i in range(int(sys.argv[1])):
    p = rng.integers(3, 49000, (1, 64)).tolist()
    acc["t"] = 0.0; acc["n"] = 0
    res = r.generate(p, 128)
    dec = res.total_s - res.ttft_s
    print(f"decode {127/dec:.1f} tok/s, step {dec/127*1e3:.2f} ms; ORT runs {acc['n']} total {acc['t']*1e3:.0f} ms = {acc['t']/acc['n']*1e3:.2f} ms each; whole {res.total_s*1e3:.0f} ms", flush=True)
