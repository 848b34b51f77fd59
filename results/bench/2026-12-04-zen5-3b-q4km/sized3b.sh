#!/bin/bash
# The 3B Q4_K_M preset with CachedAttention (--artifact) beside its GroupQueryAttention twin
# (--baseline, gqa_twin.py) and llama-batched-bench on the same file, rounds alternated.
cd /work/main
echo "=== 3b-q4km $(date -u +%H:%M:%S)"
.venv/bin/python -m benchmarks sized-speed --gguf .cache/bench-work/sized/llama-3b/llama-3b-Q4_K_M.gguf \
  --artifact /tmp/s18/x-3b-Q4_K_M --baseline /tmp/s18/gqa-3b-Q4_K_M --batches 1,8,32 --rounds 2 \
  --json /tmp/s18/sized/3b-q4km.json
echo "=== done $(date -u +%H:%M:%S)"
