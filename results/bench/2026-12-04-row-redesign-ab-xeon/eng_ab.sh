# Usage: bash eng_ab.sh DRIVER ROUNDS   (DRIVER: eng_ab.py or eng_b1.py, beside this script)
# one process per tree a round, the order flipped each round; one output line each
here=$(cd "$(dirname "$0")" && pwd)
source /work/main/.venv/bin/activate
for r in $(seq "$2"); do
  if [ $((r % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  for t in $order; do
    tree=/work/main; [ $t = old ] && tree=/tmp/ab58/old
    echo "$r $t $(cd $tree && PYTHONPATH=$tree ATTNSERVE_LOG_LEVEL=warning python "$here/$1" /tmp/ab58/art 2>/dev/null | tail -1)"
  done
done
