#!/bin/bash
# the served 1B Q4_0 preset at batch 8 and 32, the op library before (HEAD's) and after the
# chained-vpdpbusd change, alternated; llama.cpp in each run
cd /work/main
OLD=/tmp/s19/lib-old/libattnserve_gguf_ops.so
NEW=/tmp/s19/lib-new/0.3.36-ort1.21-7caff9c0219d/libattnserve_gguf_ops.so
G=${GGUF:-.cache/bench-work/sized/llama-1b/llama-1b-Q4_0.gguf}
for L in "$@"; do
  case $L in old) P=$OLD;; new) P=$NEW;; exp) P=/tmp/s19/lib-exp/0.3.36-ort1.21-b0f4d1ea81f6/libattnserve_gguf_ops.so;; new3) P=/tmp/s19/lib-new3/0.3.36-ort1.21-7c017afcbeda/libattnserve_gguf_ops.so;; new2) P=/tmp/s19/lib-new2/0.3.36-ort1.21-9f955bcb6451/libattnserve_gguf_ops.so;; esac
  echo "== $L $(date -u +%H:%M:%S)"
  ATTNSERVE_GGUF_OPS=$P .venv/bin/python -m benchmarks sized-speed --gguf $G --artifact ${ART:-/tmp/s18/x-1b-Q4_0} --batches ${BATCHES:-8,32} --rounds 1 2>&1 | grep -A8 "^decode tok/s" | head -8
done
