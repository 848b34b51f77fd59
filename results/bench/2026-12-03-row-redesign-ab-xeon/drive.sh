cd /work/main
while pgrep -f setup2.sh >/dev/null; do sleep 5; done
for t in "$@"; do
  tree=/tmp/bis/wt-$t; [ $t = old ] && tree=/tmp/bis/old; [ $t = head ] && tree=/work/main
  echo "$t $(date -u +%H:%M:%S) $(.venv/bin/python /tmp/bis/ratio.py $tree /tmp/bis/art /tmp/bis/adapters /tmp/bis/out-$t-$(date +%s) 2 2>&1 | tail -1)"
done
