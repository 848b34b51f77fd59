"""Issue 58's HTTP and LoRA serving A/B: the server of the tree at fb47ae4 (the row
redesign's base) against today's, on the same artifact (exported by the old tree, which
both read) and the same load, rounds alternated, the order flipped each round.

Per round and tree: `python -m service.cli serve` from that tree (its own checkout first on
sys.path), 2 intra-op threads, batch 32, 4 PEFT adapters loaded (--lora-modules); then
today's `python -m benchmarks serve` twice against it: base requests, and the same load
spread over the 4 adapters (--adapters). Output tokens/s of each.

Usage: python ab.py OLD_TREE NEW_TREE ARTIFACT ADAPTERS_DIR OUT_DIR [ROUNDS]
"""
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

OLD, NEW, ART, ADAPTERS, OUT = (Path(a).resolve() for a in sys.argv[1:6])
ROUNDS = int(sys.argv[6]) if len(sys.argv) > 6 else 3
OUT.mkdir(parents=True, exist_ok=True)
NAMES = sorted(p.name for p in ADAPTERS.iterdir() if p.is_dir())
PY = sys.executable


def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(tree: Path, p: int, log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(tree), ATTNSERVE_INTRA_OP_THREADS="2",
               ATTNSERVE_MAX_BATCH_SIZE="32", ATTNSERVE_LOG_LEVEL="warning")
    modules = [f"{n}={ADAPTERS / n}" for n in NAMES]
    return subprocess.Popen([PY, "-m", "service.cli", "serve", "--model", str(ART), "--host",
                             "127.0.0.1", "--port", str(p), "--max-total-tokens", "1024",
                             "--max-lora-rank", "8", "--max-loras", str(len(NAMES)),
                             "--lora-modules", *modules],
                            cwd=tree, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "server exited"
        try:
            if httpx.get(url + "/ready", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} never ready")


def load(url: str, label: str, adapters: bool) -> float:
    command = [PY, "-m", "benchmarks.serve", "--url", url, "--model", str(ART), "--backend",
               "openai", "--workload", "random", "--input-len", "64", "--output-len", "64",
               "--ignore-eos", "--num-prompts", os.environ.get("PROMPTS", "48"), "--max-concurrency", "16",
               "--request-rate", "inf", "--result-dir", str(OUT / label), "--label", label]
    if adapters:
        command += ["--adapters", ",".join(NAMES)]
    with (OUT / f"{label}.log").open("wb") as log:
        subprocess.run(command, cwd=NEW, stdout=log, stderr=subprocess.STDOUT, check=True)
    result = sorted((OUT / label).glob("*.json"))[-1]
    return float(json.loads(result.read_text())["output_throughput"])


rows = []
for r in range(1, ROUNDS + 1):
    order = [("old", OLD), ("new", NEW)] if r % 2 else [("new", NEW), ("old", OLD)]
    row: dict = {"round": r}
    for name, tree in order:
        p = port()
        proc = serve(tree, p, OUT / f"server-{name}-r{r}.log")
        try:
            ready(f"http://127.0.0.1:{p}", proc)
            row[f"{name}_base"] = load(f"http://127.0.0.1:{p}", f"{name}-base-r{r}", False)
            row[f"{name}_lora"] = load(f"http://127.0.0.1:{p}", f"{name}-lora-r{r}", True)
        finally:
            proc.terminate()
            proc.wait(60)
    print(json.dumps(row), flush=True)
    rows.append(row)
summary = {k: statistics.median(x[k] for x in rows) for k in rows[0] if k != "round"}
summary["base new/old"] = round(summary["new_base"] / summary["old_base"], 3)
summary["lora new/old"] = round(summary["new_lora"] / summary["old_lora"], 3)
print(json.dumps(summary), flush=True)
(OUT / "summary.json").write_text(json.dumps({"rounds": rows, "medians": summary}, indent=2))
