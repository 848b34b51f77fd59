"""LoRA/base output-throughput ratio of one tree's server, run from today's tree (its client).
Usage: python ratio.py TREE ARTIFACT ADAPTERS OUT REPS"""
import json, os, socket, subprocess, sys, time, statistics
from pathlib import Path
import httpx
TREE, ART, ADAPTERS, OUT = (Path(a).resolve() for a in sys.argv[1:5])
REPS = int(sys.argv[5])
NEW = Path.cwd()  # today's tree, whose benchmarks.serve is the client
OUT.mkdir(parents=True, exist_ok=True)
NAMES = sorted(p.name for p in ADAPTERS.iterdir() if p.is_dir())
PY = sys.executable
def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]
p = port()
env = dict(os.environ, PYTHONPATH=str(TREE), ATTNSERVE_INTRA_OP_THREADS="2",
           ATTNSERVE_MAX_BATCH_SIZE="32", ATTNSERVE_LOG_LEVEL="warning")
modules = [f"{n}={ADAPTERS / n}" for n in NAMES]
proc = subprocess.Popen([PY, "-m", "service.cli", "serve", "--model", str(ART), "--host",
    "127.0.0.1", "--port", str(p), "--max-total-tokens", "1024", "--max-lora-rank", "8",
    "--max-loras", str(len(NAMES)), "--lora-modules", *modules], cwd=TREE, env=env,
    stdout=(OUT / "server.log").open("wb"), stderr=subprocess.STDOUT)
url = f"http://127.0.0.1:{p}"
try:
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, "server exited"
        try:
            if httpx.get(url + "/ready", timeout=5).status_code == 200: break
        except httpx.TransportError: pass
        assert time.monotonic() < deadline
        time.sleep(0.5)
    res = {"base": [], "lora": []}
    order = []
    for r in range(REPS):
        order += (["base", "lora"] if r % 2 == 0 else ["lora", "base"])
    for i, kind in enumerate(order):
        label = f"{kind}-{i}"
        cmd = [PY, "-m", "benchmarks.serve", "--url", url, "--model", str(ART), "--backend",
               "openai", "--workload", "random", "--input-len", "64", "--output-len", "64",
               "--ignore-eos", "--num-prompts", "48", "--max-concurrency", "16",
               "--request-rate", "inf", "--result-dir", str(OUT / label), "--label", label]
        if kind == "lora": cmd += ["--adapters", ",".join(NAMES)]
        with (OUT / f"{label}.log").open("wb") as log:
            subprocess.run(cmd, cwd=NEW, stdout=log, stderr=subprocess.STDOUT, check=True)
        f = sorted((OUT / label).glob("*.json"))[-1]
        res[kind].append(float(json.loads(f.read_text())["output_throughput"]))
    out = {k: v for k, v in res.items()}
    out["ratio"] = round(statistics.median(res["lora"]) / statistics.median(res["base"]), 3)
    print(json.dumps(out), flush=True)
finally:
    proc.terminate(); proc.wait(60)
