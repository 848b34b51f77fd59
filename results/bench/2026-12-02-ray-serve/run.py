"""Ray Serve's proxy against the same replicas served directly (issue: throughput at 16
clients through Serve >= 0.9x the sum of the replicas alone). Alternates, per round:
  direct: two `attnserve serve` processes (1 intra-op thread each), 8 clients on each at once;
  ray:    a 3-node local Ray cluster (head: proxy and controller, 0 CPUs for replicas; two
          nodes of 1 CPU), service.ray_app with 2 replicas (1 a node), 16 clients on the proxy.
Each run: python -m benchmarks.serve, OpenAI completions, random 64 -> 128 tokens, ignore-eos.
Usage: python results/bench/2026-12-02-ray-serve/run.py OUT_DIR [ROUNDS]
"""
import json, os, socket, subprocess, sys, time
from pathlib import Path
import httpx

ART = "artifacts/smollm2-135m-instruct"
OUT = Path(sys.argv[1]); OUT.mkdir(parents=True, exist_ok=True)
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 2
PY = sys.executable


def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]


def wait_ready(url, n=1, timeout=300):
    seen, deadline = set(), time.monotonic() + timeout
    while len(seen) < n:
        assert time.monotonic() < deadline, url
        try:
            r = httpx.get(url + "/ready", timeout=10)
            if r.status_code == 200:
                seen.add(r.headers.get("x-attnserve-replica", url))
                continue
        except httpx.TransportError:
            pass
        time.sleep(0.5)


def bench(url, clients, prompts, label):
    res = OUT / label
    cmd = [PY, "-m", "benchmarks.serve", "--url", url, "--model", ART, "--backend", "openai",
           "--workload", "random", "--input-len", "64", "--output-len", "128", "--ignore-eos",
           "--num-prompts", str(prompts), "--max-concurrency", str(clients),
           "--request-rate", "inf", "--result-dir", str(res), "--label", label]
    return subprocess.Popen(cmd, stdout=open(OUT / f"{label}.log", "w"), stderr=subprocess.STDOUT)


def throughput(label):
    files = sorted((OUT / label).glob("*.json"))
    data = json.loads(files[-1].read_text())
    return float(data["output_throughput"])


results = []
for rnd in range(1, ROUNDS + 1):
    # direct
    ports = [port(), port()]
    env = dict(os.environ, ATTNSERVE_INTRA_OP_THREADS="1")
    procs = [subprocess.Popen([PY, "-m", "service.cli", "serve", "--model", ART, "--port", str(p),
                               "--max-total-tokens", "1024"], env=env,
                              stdout=open(OUT / f"direct-{rnd}-{p}.log", "w"), stderr=subprocess.STDOUT)
             for p in ports]
    for p in ports:
        wait_ready(f"http://127.0.0.1:{p}")
    clients = [bench(f"http://127.0.0.1:{p}", 8, 32, f"direct-r{rnd}-{i}") for i, p in enumerate(ports)]
    for c in clients:
        c.wait()
    for p in procs:
        p.terminate(); p.wait()
    direct = [throughput(f"direct-r{rnd}-{i}") for i in range(2)]
    # ray
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster
    from service.ray_app import build_app
    os.environ["RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING"] = "0"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    cluster.add_node(num_cpus=1); cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    rp = port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": rp})
    serve.run(build_app({"serve": {"model": str(Path(ART).resolve()), "intra_op_threads": 1,
                                   "max_total_tokens": 1024},
                         "min_replicas": 2, "max_replicas": 2, "max_replicas_per_node": 1,
                         "num_cpus": 1}), name="attnserve", route_prefix="/", blocking=False)
    wait_ready(f"http://127.0.0.1:{rp}", n=2)
    c = bench(f"http://127.0.0.1:{rp}", 16, 64, f"ray-r{rnd}"); c.wait()
    ray_tp = throughput(f"ray-r{rnd}")
    serve.shutdown(); ray.shutdown(); cluster.shutdown()
    row = {"round": rnd, "direct": direct, "direct_sum": sum(direct), "ray": ray_tp,
           "ratio": ray_tp / sum(direct)}
    print(json.dumps(row), flush=True)
    results.append(row)
(OUT / "summary.json").write_text(json.dumps(results, indent=2))
