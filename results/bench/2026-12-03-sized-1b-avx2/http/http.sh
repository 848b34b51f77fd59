#!/bin/bash
# llama-server then attnserve on the 1B Q4_K_M file, concurrency 16, 32 requests, one round
set -u
cd /work/main
. .venv/bin/activate
FILE=.cache/bench-work/sized/llama-1b/llama-1b-Q4_K_M.gguf
ART=/tmp/b3/km1b-after
OUT=/tmp/s8/http
wait_up() { for i in $(seq 1 240); do curl -sf "$1" >/dev/null && return 0; sleep 0.5; done; return 1; }
for server in llama ours; do
  if [ $server = llama ]; then
    .cache/llamacpp-tools/build/bin/llama-server -m $FILE -t 2 -tb 2 -c 4096 -np 16 --port 8181 > $OUT/llama-server.log 2>&1 &
    PID=$!; URL=http://127.0.0.1:8181; wait_up $URL/health
  else
    ATTNSERVE_INTRA_OP_THREADS=2 attnserve serve --model $ART --port 8182 --max-total-tokens 1024 > $OUT/attnserve.log 2>&1 &
    PID=$!; URL=http://127.0.0.1:8182; wait_up $URL/ready
  fi
  python -m benchmarks.serve --url $URL --model $ART --backend openai --workload random \
    --input-len 64 --output-len 128 --ignore-eos --num-prompts 32 --max-concurrency 16 \
    --request-rate inf --result-dir $OUT/$server-c16 > $OUT/$server-c16.log 2>&1
  echo "$server conc 16: $(grep -i 'output token throughput\|Output token' $OUT/$server-c16.log | head -1)"
  kill $PID; wait $PID 2>/dev/null
done
