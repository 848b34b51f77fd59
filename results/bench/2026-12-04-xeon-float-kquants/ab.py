"""One GgufMatMul product at float activations, two libraries alternated (each in its own
process: a library is loaded once a process). Usage: ab.py TYPE N M,M.. LIB_A LIB_B ROUNDS"""
import os, subprocess, sys
typ, n, ms, a, b, rounds = sys.argv[1:7]
threads = int(os.environ.get('THREADS', '2'))
clock = 'time.process_time' if threads == 1 else 'time.perf_counter'
code = f'''
THREADS = {threads}
import time
CLOCK = {clock}
import sys, numpy as np, time
sys.path.insert(0, ".")
from benchmarks.gguf_matmul_speed import gguf_weights, gguf_model, session, median_seconds
rng = np.random.default_rng(0)
tid, stored, dense = gguf_weights("{typ}", {n}, {n}, rng)
s = session(gguf_model(tid, stored, {n}, activations="float"), THREADS)
out = []
for m in [{ms}]:
    x = rng.standard_normal((m, {n}), dtype=np.float32)
    out.append(f"M={{m}} {{median_seconds(lambda: s.run(None, {{'X': x}}), clock=CLOCK)*1e3:.3f}}")
print("  ".join(out))
'''
import os
for r in range(int(rounds)):
    for name, lib in (("A", a), ("B", b)):
        env = dict(os.environ, ATTNSERVE_GGUF_OPS=lib)
        res = subprocess.run([".venv/bin/python", "-c", code], env=env, capture_output=True, text=True)
        print(f"{typ} N=K={n} {name}: {res.stdout.strip()} {res.stderr.strip()[-200:]}", flush=True)
