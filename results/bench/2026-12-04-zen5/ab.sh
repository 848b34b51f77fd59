#!/bin/bash
# The 1B Q4_0 file at batches 8 and 32, the library of 2262855 ("before") and the pair kernel ("p128") alternated.
cd /work/main
S=.cache/bench-work/sized/llama-1b
for r in 1 2 3; do for v in before p128; do
  echo "=== $v round $r $(date -u +%H:%M:%S)"
  ATTNSERVE_GGUF_OPS=/tmp/s16/lib-$v/libattnserve_gguf_ops.so .venv/bin/python -m benchmarks sized-speed --gguf $S/llama-1b-Q4_0.gguf --artifact /tmp/s16/art-1b-Q4_0 --batches 8,32 --rounds 1 2>&1 | grep -E "^batch|round"
done; done
