"""Run `attnserve export ...` with memory printed around the verification's pieces.

Usage (repository root): python results/bench/2026-12-04-zen5-export-checks/trace_export.py \
    export --ckpt CKPT --out OUT --engine-graph --force --quantize gguf
"""
import sys, time, functools
import export.quantize.weights as w
T0 = time.time()
def status(key):
    """A /proc/self/status figure in MB (VmHWM: the peak so far; VmRSS: resident now)."""
    for line in open('/proc/self/status'):
        if line.startswith(key + ':'):
            return int(line.split()[1]) // 1024
def mark(tag):
    print(f"RSS {time.time()-T0:7.1f}s {tag}: hwm {status('VmHWM')} rss {status('VmRSS')}",
          flush=True)
def wrap(mod, name):
    f = getattr(mod, name)
    @functools.wraps(f)
    def g(*a, **k):
        mark(f"{name} start")
        out = f(*a, **k)
        mark(f"{name} end")
        return out
    setattr(mod, name, g)
for n in ("greedy", "agreement_with", "perplexity", "release"):
    wrap(w, n)
import export.from_blocks as fb
for n in ("compare_decoders", "write_served_adapter_graphs", "verify_engines"):
    if hasattr(fb, n): wrap(fb, n)
import export.verify.engine_parity as ep
orig_init = ep.EngineDecoder.__init__
def init(self, *a, **k):
    mark("EngineDecoder init start"); orig_init(self, *a, **k); mark("EngineDecoder init end")
ep.EngineDecoder.__init__ = init
from service.cli import main
sys.exit(main(sys.argv[1:]))
