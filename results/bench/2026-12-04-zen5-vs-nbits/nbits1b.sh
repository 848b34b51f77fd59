#!/bin/bash
# The 1B Q4_K_M preset: our GgufMatMul export beside a --kernel nbits (MatMulNBits) export of the
# same file (--baseline) and llama-batched-bench, rounds alternated.
cd /work/main
echo "=== export nbits $(date -u +%H:%M:%S)"
/usr/bin/time -f "wall %e s peak %M kB" .venv/bin/attnserve export --ckpt /tmp/s16/ck-1b-Q4_K_M --out /tmp/s18/nbits-1b-Q4_K_M \
  --engine-graph --force --quantize gguf --kernel nbits 2>&1 | grep -E "token agreement|weights.bin|^wall|exported"
echo "=== sized $(date -u +%H:%M:%S)"
.venv/bin/python -m benchmarks sized-speed --gguf .cache/bench-work/sized/llama-1b/llama-1b-Q4_K_M.gguf \
  --artifact /tmp/s18/x-1b-Q4_K_M --baseline /tmp/s18/nbits-1b-Q4_K_M --batches 1,8,32 --rounds 2 \
  --json /tmp/s18/sized/1b-q4km-vs-nbits.json
echo "=== done $(date -u +%H:%M:%S)"
