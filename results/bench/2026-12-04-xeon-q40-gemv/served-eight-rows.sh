cd /work/main; source .venv/bin/activate
for lib in new old; do
  if [ $lib = old ]; then export ATTNSERVE_GGUF_OPS=/tmp/g8/old/libattnserve_gguf_ops.so; else unset ATTNSERVE_GGUF_OPS; fi
  python -m benchmarks sized-speed --gguf .cache/bench-work/sized/llama-3b/llama-3b-Q4_0.gguf --artifact /tmp/s14/x3b/art-q40 --batches 8 --rounds 2 --json /tmp/g8/served-3b-b8-$lib.json > /tmp/g8/served-3b-b8-$lib.log 2>&1
done
