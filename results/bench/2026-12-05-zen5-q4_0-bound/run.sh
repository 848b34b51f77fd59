#!/usr/bin/env bash
# Builds and runs this directory's kernel experiments from the repository root (after
# `make gguf-ops`, which fetches the headers they include into .cache/). Each program
# includes service/ops/gguf_rowdot.cc as it is at the commit checked out.
set -euo pipefail
here=$(dirname "$0")
inc="-I. -Iservice/ops -I.cache/llamacpp-tools/src/ggml/include"
inc+=" -I$(dirname "$(find .cache/ort-headers -name onnxruntime_cxx_api.h | head -1)")"
for p in lanes_parts; do
  g++ -O3 -march=native -std=c++17 $inc "$here/$p.cc" -o "/tmp/$p"
done
g++ -O3 -march=native -std=c++20 -pthread $inc "$here/chunks.cc" -o /tmp/chunks
/tmp/lanes_parts > "$here/lanes-parts.txt"
for round in 1 2 3; do
  for mode in 0 1; do /tmp/chunks 65536 $mode 32; done
done > "$here/chunks-harness.txt"
g++ -O3 -march=native -std=c++17 $inc "$here/attention_task.cc" -o /tmp/attention_task
{
  /tmp/attention_task 128 1 0
  /tmp/attention_task 128 64 0
  for round in 1 2; do
    for mode in 0 3 5 6; do /tmp/attention_task 128 4096 $mode; done
  done
} > "$here/attention-task.txt"
