# The SwiGLU epilogue of one product: median microseconds a session.run (500 runs, 7
# repeats) with and without it, SmolLM2 gate | up shape (3072 x 576): python epilogue_call.py LIB
import time, numpy as np, sys
sys.path.insert(0, '.')
from pathlib import Path
import service.ops
from tests.service.ops.test_gguf_matmul import TYPES, matmul_model, session
lib = Path(sys.argv[1])
rng = np.random.default_rng(0)
k, n = 576, 3072
for name, extra in (("Q4_1", {"activations": "float"}), ("Q4_0", {})):
    stored, _ = TYPES[name].make(rng, n, k)
    for m in (1, 32):
        x = rng.standard_normal((m, k)).astype(np.float32)
        res = {}
        for epi in ("", "swiglu"):
            s = session(matmul_model(TYPES[name].type_id, k, w=stored, epilogue=epi, **extra), lib)
            for _ in range(50): s.run(None, {"X": x})
            ts = []
            for _ in range(7):
                t0 = time.perf_counter()
                for _ in range(500): s.run(None, {"X": x})
                ts.append((time.perf_counter() - t0) / 500 * 1e6)
            res[epi or "none"] = sorted(ts)[3]
        print(name, extra, "m", m, {k2: f"{v:.1f} us" for k2, v in res.items()})
