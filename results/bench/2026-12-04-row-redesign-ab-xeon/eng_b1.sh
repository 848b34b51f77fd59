cd /tmp/s15; source /work/main/.venv/bin/activate
for r in 1 2 3 4 5 6; do
  if [ $((r % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  for t in $order; do
    tree=/work/main; [ $t = old ] && tree=/tmp/ab58/old
    echo "$r $t $(cd $tree && PYTHONPATH=$tree ATTNSERVE_LOG_LEVEL=warning python /tmp/s15/eng_b1.py /tmp/ab58/art 2>/dev/null | tail -1)"
  done
done
