#!/bin/bash
# Export A/B: HEAD (old: check graphs MatMulNBits level 0) against the tree (GgufMatMul float)
LIB=$(readlink -f /work/main/.cache/gguf-ops/current)/libattnserve_gguf_ops.so
PY=/work/main/.venv/bin/python
run() {  # tree ckpt out
  cd $1 && ATTNSERVE_GGUF_OPS=$LIB /usr/bin/time -f "wall %e s peak %M kB" $PY -m service.cli export --ckpt $2 --out $3 --engine-graph --force --quantize gguf 2>&1 | grep -E "token agreement|weights.bin is|^wall|exported|verified at"
}
for f in 1b-Q4_0 1b-Q4_K_M; do
  for tree in /tmp/s18/old /work/main /tmp/s18/old /work/main; do
    echo "== $f $tree $(date +%T)"; run $tree /tmp/s16/ck-$f /tmp/s18/x-$f
  done
done
echo "== import 3b-Q4_K_M"; cd /work/main && $PY -m service.cli import --gguf .cache/bench-work/sized/llama-3b/llama-3b-Q4_K_M.gguf --out /tmp/s18/ck-3b-Q4_K_M --force 2>&1 | tail -1
for f in 3b-Q4_0; do echo "== $f new $(date +%T)"; run /work/main /tmp/s16/ck-$f /tmp/s18/x-$f; done
echo "== 3b-Q4_K_M new $(date +%T)"; run /work/main /tmp/s18/ck-3b-Q4_K_M /tmp/s18/x-3b-Q4_K_M
echo "== 3b-Q4_K_M old $(date +%T)"; run /tmp/s18/old /tmp/s18/ck-3b-Q4_K_M /tmp/s18/x-3b-Q4_K_M
echo done
