#!/bin/bash
# The served 1B Q4_0 preset (a --kernel ggml export: ART) at batch 8 and 32 beside
# llama-batched-bench, the op library of dad321f ("old") and of this change ("new")
# alternated: `bash served_ab.sh old new old new`. OLD and NEW: the libraries, each built
# with `python -m service.ops.build --out DIR` at its commit.
cd "$(dirname "$0")/../../.." || exit 1
G=${GGUF:-.cache/bench-work/sized/llama-1b/llama-1b-Q4_0.gguf}
for L in "$@"; do
  case $L in old) P=$OLD;; new) P=$NEW;; esac
  echo "== $L $(date -u +%H:%M:%S)"
  ATTNSERVE_GGUF_OPS=$P .venv/bin/python -m benchmarks sized-speed --gguf "$G" --artifact "$ART" \
    --batches "${BATCHES:-8,32}" --rounds 1 2>&1 | grep -A8 "^decode tok/s" | head -8
done
