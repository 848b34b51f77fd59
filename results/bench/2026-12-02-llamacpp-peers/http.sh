#!/bin/bash
# alternate llama-server and attnserve on the 1B Q4_K_M file, 2 rounds, concurrency 1 and 16
set -u
cd /work/main
. .venv/bin/activate
FILE=.cache/bench-work/sized/llama-1b/llama-1b-Q4_K_M.gguf
ART=/tmp/b1/km-ggml
OUT=/tmp/rp/http
mkdir -p $OUT
wait_up() { for i in $(seq 1 240); do curl -sf "$1" >/dev/null && return 0; sleep 0.5; done; return 1; }
for round in 1 2; do
  for server in llama ours; do
    if [ $server = llama ]; then
      .cache/llamacpp-tools/build/bin/llama-server -m $FILE -t 2 -tb 2 -c 4096 -np 16 --port 8181 > $OUT/llama-server-$round.log 2>&1 &
      PID=$!; URL=http://127.0.0.1:8181; wait_up $URL/health
    else
      ATTNSERVE_INTRA_OP_THREADS=2 attnserve serve --model $ART --port 8182 > $OUT/attnserve-$round.log 2>&1 &
      PID=$!; URL=http://127.0.0.1:8182; wait_up $URL/ready  # /health answers while loading
    fi
    for conc in 1 16; do
      n=$([ $conc = 1 ] && echo 8 || echo 32)
      python -m benchmarks.serve --url $URL --model $ART --backend openai --workload random \
        --input-len 64 --output-len 128 --ignore-eos --num-prompts $n --max-concurrency $conc \
        --request-rate inf --result-dir $OUT/$server-c$conc-r$round > $OUT/$server-c$conc-r$round.log 2>&1
      echo "$server round $round conc $conc: $(grep -i 'output token throughput\|Output token' $OUT/$server-c$conc-r$round.log | head -1)"
    done
    kill $PID; wait $PID 2>/dev/null
  done
done
