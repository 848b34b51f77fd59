set -x
cd /work/main
S=.cache/bench-work/sized/llama-1b
B=".venv/bin/python -m benchmarks sized-speed"
for round in 1 2; do
for lib in new lib-3cc7233; do
date -u
ATTNSERVE_GGUF_OPS=/tmp/k57/$lib/libattnserve_gguf_ops.so $B --gguf $S/llama-1b-Q4_K_M.gguf --artifact /tmp/i57/art-Q4_K_M --batches 8,32 --rounds 1 --json /tmp/p58/km-$lib-$round.json > /tmp/p58/km-$lib-$round.log 2>&1
done
done
date -u
echo speed-done
