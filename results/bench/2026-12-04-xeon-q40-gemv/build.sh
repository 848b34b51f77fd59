# quick rebuild of our library only, against the cached ggml libraries: build.sh OUTDIR
set -e
cd ${SRC:-/work/main}
OUT=$1; mkdir -p $OUT
cp /work/main/.cache/gguf-ops/current/libggml-base.so.0 /work/main/.cache/gguf-ops/current/libggml-cpu.so.0 $OUT/
g++ -O3 -march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 -fPIC -shared -std=c++17 -fvisibility=hidden \
  -Wall -Wextra -DATTNSERVE_GGUF_OPS_LEVEL=3 \
  -I /work/main/.cache/ort-headers/libonnxruntime-dev_1.21.0+dfsg-1_amd64/usr/include/onnxruntime \
  -I /work/main/.cache/llamacpp-tools/src/ggml/include \
  service/ops/gguf_*.cc \
  -L$OUT -l:libggml-base.so.0 -l:libggml-cpu.so.0 -Wl,-rpath,'$ORIGIN' -Wl,--no-undefined \
  -o $OUT/libattnserve_gguf_ops.so
echo built $OUT/libattnserve_gguf_ops.so
