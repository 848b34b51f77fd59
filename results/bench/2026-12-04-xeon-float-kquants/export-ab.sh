# The 1B Q4_K_M export with the old and the new op library, alternated: BASE=dir NEW=dir OUT=dir
set -x
cd /work/main
. .venv/bin/activate
for round in ${ROUNDS:-1 2}; do
for v in ${ORDER:-BASE NEW}; do
  lib="${!v}/libattnserve_gguf_ops.so"
  date -u
  ATTNSERVE_GGUF_OPS=$lib /usr/bin/time -v attnserve export --ckpt /tmp/s13/x1b/ckpt-km --out $OUT/km-$v-$round --engine-graph --quantize gguf --force > $OUT/export-$v-$round.log 2>&1
  grep -E "Elapsed|Maximum resident|exported" $OUT/export-$v-$round.log
  rm -rf $OUT/km-$v-$round
done
done
date -u
