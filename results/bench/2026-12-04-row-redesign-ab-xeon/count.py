"""Issue 58's count: non-test Python lines each package gained or lost from fb47ae4 to HEAD,
outside tests/ and results/, split into the commits of issue 58 (listed, from its closing notes) and every other commit
(git log --numstat, renames counted as delete + add). Usage: python count.py [MORE_58_COMMITS...]
(repository root; later sessions' issue-58 commits given as arguments)."""
import subprocess, collections, sys
I58 = set("9fdf25c 6ef9439 1becc41 d5a4e27 a82fd10 3a20545 fb13a86 d71242b caaa9f7 ec094e2 1192a57 e2e5bb2 22cf9fd 2e0d996 889d2d0 deef8ba 34591da db78d00 ea116dd 7dac7b1 a786698 1d828e3 3f2520b 4c1f74a 6195674 e059c6a b4fe7a9 aa286ed 6768c9f 7782a59 6fda0cb 2f92d9f b217eeb fb9803d 90f6b38 c831183 1a74963 0f06bf5 d89241b df3e26c 3870268 6b19979 6d77a43 1541fcf 078ba73 0c12bec".split()) | {c[:7] for c in sys.argv[1:]}
PKGS = ["export", "service/engine", "service/ops", "service", "model", "benchmarks"]
out = subprocess.run(["git", "log", "--format=C %h", "--numstat", "--no-renames", "fb47ae4..HEAD"], capture_output=True, text=True).stdout
tot = {k: collections.Counter() for k in ("58", "other")}
cur = None
for line in out.splitlines():
    if line.startswith("C "):
        cur = "58" if line[2:9] in I58 else "other"; continue
    if not line.strip(): continue
    a, b, f = line.split("\t")
    if a == "-" or not f.endswith(".py") or f.startswith(("tests/", "results/")): continue
    d = int(a) - int(b)
    for p in PKGS:
        if f.startswith(p + "/") or (p == "service" and f.startswith("service")):
            tot[cur][p] += d
    tot[cur]["all"] += d
for k in ("58", "other"):
    print(k, dict(tot[k]))
