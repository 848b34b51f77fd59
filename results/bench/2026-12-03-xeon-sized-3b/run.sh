set -x
cd "$(dirname "$0")/../../.."
OUT=${OUT:?}
. .venv/bin/activate
date -u
python -m benchmarks sized-presets --preset llama-3b --drop-hf > $OUT/presets.log 2>&1
date -u
attnserve import --gguf .cache/bench-work/sized/llama-3b/llama-3b-Q4_K_M.gguf --out $OUT/ckpt-km > $OUT/import-km.log 2>&1
date -u
/usr/bin/time -v attnserve export --ckpt $OUT/ckpt-km --out $OUT/km --engine-graph --quantize gguf > $OUT/export-km.log 2>&1
date -u
python -m benchmarks sized-speed --gguf .cache/bench-work/sized/llama-3b/llama-3b-Q4_K_M.gguf --artifact $OUT/km --rounds 2 --new 64 --batches 1,8,32 --json $OUT/km.json > $OUT/km.log 2>&1
date -u
echo b3-done
