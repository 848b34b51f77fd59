# From the repository root; every heavy step under flock /tmp/cpu.lock (a shared 2-core host).
# old: a copy of HEAD's service/ops (git archive HEAD service/ops); new: the working tree's;
# pfD: new with kRepackedPrefetchBlocks = D. Each built by the g++ line of build.sh below.
set -x
source .venv/bin/activate
R=results/bench/2026-12-04-xeon-q40-gemv
G=.cache/bench-work/sized/llama-3b/llama-3b-Q4_0.gguf
A=/tmp/s14/x3b/art-q40
lib() { echo /tmp/q40/$1/libattnserve_gguf_ops.so; }
# served, batch 1, new then old
ATTNSERVE_GGUF_OPS=$(lib new) flock /tmp/cpu.lock python -m benchmarks sized-speed --gguf $G --artifact $A --batches 1 --rounds 3 --json $R/served-3b-new.json > $R/served-3b-new.log 2>&1
ATTNSERVE_GGUF_OPS=$(lib old) flock /tmp/cpu.lock python -m benchmarks sized-speed --gguf $G --artifact $A --batches 1 --rounds 3 --json $R/served-3b-old.json > $R/served-3b-old.log 2>&1
# prefetch distance: 0, 16, 64 blocks beside 32 (new)
for d in 0 16 64; do [ -f $(lib pf$d) ] || SRC=/tmp/q40/src-pf$d flock /tmp/cpu.lock bash /tmp/k57/build.sh /tmp/q40/pf$d > /tmp/q40/pf$d-build.log 2>&1; done
for i in 1 2; do for v in pf0 pf16 new pf64; do
  ATTNSERVE_GGUF_OPS=$(lib $v) flock /tmp/cpu.lock python -m benchmarks gguf-matmul-speed --cold --threads 1 --cpu-time --sizes 8192 --batches 1,2,3 --types Q4_0 --paths repacked > $R/prefetch-$i-$v.txt 2>&1
done; done
# rem: new with M = 5-7 as ggml's gemm on 4 rows and our gemv on the rest (not kept unless faster)
SRC=/tmp/q40/src-rem flock /tmp/cpu.lock bash /tmp/k57/build.sh /tmp/q40/rem > /tmp/q40/rem-build.log 2>&1
for i in 1 2; do for v in new rem; do
  ATTNSERVE_GGUF_OPS=$(lib $v) flock /tmp/cpu.lock python -m benchmarks gguf-matmul-speed --cold --threads 1 --cpu-time --sizes 8192 --batches 4,5,6,7 --types Q4_0 --paths repacked > $R/remainder-$i-$v.txt 2>&1
done; done
# the 1B Q4_0 file: an artifact exported 2026-12-03 (issue 57's session) in the same layout
G1=.cache/bench-work/sized/llama-1b/llama-1b-Q4_0.gguf
A1=/tmp/i57/art-Q4_0
ATTNSERVE_GGUF_OPS=$(lib new) flock /tmp/cpu.lock python -m benchmarks sized-speed --gguf $G1 --artifact $A1 --batches 1 --rounds 3 --json $R/served-1b-new.json > $R/served-1b-new.log 2>&1
ATTNSERVE_GGUF_OPS=$(lib old) flock /tmp/cpu.lock python -m benchmarks sized-speed --gguf $G1 --artifact $A1 --batches 1 --rounds 3 --json $R/served-1b-old.json > $R/served-1b-old.log 2>&1
# the 3B again, old then new (a second alternation)
ATTNSERVE_GGUF_OPS=$(lib old) flock /tmp/cpu.lock python -m benchmarks sized-speed --gguf $G --artifact $A --batches 1 --rounds 3 --json $R/served-3b-old-2.json > $R/served-3b-old-2.log 2>&1
ATTNSERVE_GGUF_OPS=$(lib new) flock /tmp/cpu.lock python -m benchmarks sized-speed --gguf $G --artifact $A --batches 1 --rounds 3 --json $R/served-3b-new-2.json > $R/served-3b-new-2.log 2>&1
# prefill's M (64) and M = 8, old against new: the products there take the same code in both
for i in 1 2; do for v in old new; do
  ATTNSERVE_GGUF_OPS=$(lib $v) flock /tmp/cpu.lock python -m benchmarks gguf-matmul-speed --cold --threads 1 --cpu-time --sizes 8192 --batches 8,64 --types Q4_0 --paths repacked > $R/m64-$i-$v.txt 2>&1
done; done
