#!/bin/bash
# one client, prompts no server has seen (--seed 1; the 16-client runs used seed 0): 6 requests, 64 -> 128
set -u
cd /work/main
. .venv/bin/activate
FILE=.cache/bench-work/sized/llama-1b/llama-1b-Q4_K_M.gguf
ART=/tmp/i57/art-Q4_K_M
OUT=/tmp/i57/http
wait_up() { for i in $(seq 1 240); do curl -sf "$1" >/dev/null && return 0; sleep 0.5; done; return 1; }
for round in 1 2; do
  order="llama ours"; [ $round = 2 ] && order="ours llama"
  for server in $order; do
    if [ $server = llama ]; then
      .cache/llamacpp-tools/build/bin/llama-server -m $FILE -t 2 -tb 2 -c 4096 -np 16 --port 8181 > $OUT/llama-server-c1seed1-r$round.log 2>&1 &
      PID=$!; URL=http://127.0.0.1:8181; wait_up $URL/health
    else
      ATTNSERVE_INTRA_OP_THREADS=2 attnserve serve --model $ART --port 8182 --max-total-tokens 1024 > $OUT/attnserve-c1seed1-r$round.log 2>&1 &
      PID=$!; URL=http://127.0.0.1:8182; wait_up $URL/ready
    fi
    python -m benchmarks.serve --url $URL --model $ART --backend openai --workload random \
      --input-len 64 --output-len 128 --ignore-eos --num-prompts 6 --max-concurrency 1 --seed 1 \
      --request-rate inf --result-dir $OUT/$server-c1seed1-r$round > $OUT/$server-c1seed1-r$round.log 2>&1
    echo "r$round $server conc 1 seed 1: $(grep -E 'Output token throughput|Median TTFT|Median TPOT' $OUT/$server-c1seed1-r$round.log | tr -s ' ' | tr '\n' ' ')"
    kill $PID; wait $PID 2>/dev/null
  done
done
