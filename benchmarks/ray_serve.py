"""Ray Serve's proxy against the same replicas served directly: output tokens/s of one load
sent through Serve, against the sum of the same load split over the replicas' own ports.

Usage (from the repository root, in the dev venv with the ray extra; ``make artifact``):
    python -m benchmarks ray-serve --out results/bench/mine/ray_serve.json
    # the engines on CPU 1, everything else (Ray's head, Serve's proxy and the adapter
    # router, the load clients) on CPU 0: a cluster whose proxy has cores of its own
    python -m benchmarks ray-serve --engine-cpus 1 --other-cpus 0 --rounds 2
    # where adapters land: 3 replicas, 4 adapters named in the body
    python -m benchmarks lora-adapters --model ARTIFACT --out /tmp/adapters --count 4 --rank 8
    python -m benchmarks ray-serve --arms ray-adapters --adapters /tmp/adapters --replicas 3 \
        --rounds 1

Each round runs its arms one after the other on the same machine:

* **direct**: ``--replicas`` `attnserve serve` processes (one intra-op thread each), the
  clients split evenly over their ports, all at once; the figure is their summed output
  tokens/s.
* **ray-header** / **ray-body**: a local Ray cluster (a head node with Serve's proxy and
  controller and no CPU for engines, and one node a replica, ``ray.cluster_utils.Cluster``),
  service/ray_app.py with ``--replicas`` replicas, ``adapter_routing`` header (the replicas
  are the ingress) or body (the adapter router in front, placed on the head by a custom
  resource), all ``--clients`` on the proxy.

* **ray-adapters**: body routing with the PEFT adapters of ``--adapters`` served at run
  time: one request for each alone (the warm-up), then ``--adapter-requests`` short
  completions naming them in turn, ``--clients`` at a time; the replicas each adapter was
  served by, and the share of the later requests sent to a replica holding it (the
  response header names the replica).

The throughput arms' load is ``python -m benchmarks serve`` (streamed OpenAI completions, random
prompts of ``--input-len`` tokens, ``--output-len`` new ones with ``--ignore-eos``). With
``--engine-cpus`` and ``--other-cpus`` the engines (the direct servers, the Ray nodes that hold
replicas) are pinned to the first set and everything else to the second, with
sched_setaffinity, which child processes inherit. Prints one JSON line a round and the
ratios; writes them to ``--out``. Asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.lib.serving import Server, emit, http_get, load_env, max_rank, output_throughput
from benchmarks.serve.client import RequestOutput, post, send_all
from benchmarks.serve.workloads import SampleRequest

ARMS = ("direct", "ray-header", "ray-body", "ray-adapters")
INGRESS_RESOURCE = "attnserve_ingress"  # declared by the head node only


def cpus(text: str | None) -> set[int] | None:
    return None if text is None else {int(c) for c in text.split(",") if c.strip()}


def pin(pid: int, where: set[int] | None) -> None:
    """Every thread of process ``pid`` onto ``where`` (threads made later inherit it)."""
    if where is None:
        return
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task.name), where)


def load(url: str, args: argparse.Namespace, clients: int, prompts: int, label: str,
         out: Path, where: set[int] | None) -> subprocess.Popen[bytes]:
    """One `benchmarks serve` run against ``url``, in the background."""
    command = [sys.executable, "-m", "benchmarks.serve", "--url", url, "--model",
               str(args.artifact), "--backend", "openai", "--workload", "random",
               "--input-len", str(args.input_len), "--output-len", str(args.output_len),
               "--ignore-eos", "--num-prompts", str(prompts), "--max-concurrency", str(clients),
               "--request-rate", "inf", "--result-dir", str(out / label), "--label", label]
    return subprocess.Popen(command, stdout=(out / f"{label}.log").open("wb"),
                            stderr=subprocess.STDOUT,
                            preexec_fn=(lambda: os.sched_setaffinity(0, where)) if where else None)


def finish(runs: list[subprocess.Popen[bytes]], labels: list[str], out: Path) -> list[float]:
    for run, label in zip(runs, labels, strict=True):
        if run.wait() != 0:
            raise SystemExit(f"ray-serve: the load run {label} failed: see {out / label}.log")
    return [output_throughput(out / label) for label in labels]


def direct(args: argparse.Namespace, out: Path, label: str) -> float:
    env = load_env(1, dict(os.environ))
    servers = [Server(args.artifact, env, out / f"{label}-server{i}.log")
               for i in range(args.replicas)]
    try:
        for server in servers:
            server.wait_ready()
            pin(server.pid, args.engine_cpus)
        each, prompts = args.clients // args.replicas, args.requests // args.replicas
        labels = [f"{label}-{i}" for i in range(args.replicas)]
        runs = [load(server.url, args, each, prompts, name, out, args.other_cpus)
                for server, name in zip(servers, labels, strict=True)]
        return sum(finish(runs, labels, out))
    finally:
        for server in servers:
            server.stop()


@contextlib.contextmanager
def affinity(where: set[int] | None) -> Iterator[None]:
    """This thread (and the processes it starts) on ``where`` for the block."""
    before = os.sched_getaffinity(0)
    if where is not None:
        os.sched_setaffinity(0, where)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def replicas_ready(url: str, n: int, timeout: float = 300.0) -> None:
    """Until ``n`` distinct replicas have answered /ready through the proxy."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(seen) < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"ray-serve: {len(seen)} of {n} replicas ready after {timeout} s")
        try:
            seen.add(http_get(f"{url}/ready")[1].get("x-attnserve-replica", ""))
            continue
        except OSError:  # not listening yet, or not ready
            pass
        time.sleep(0.5)


def placed(title: str) -> list[list[int]]:
    """The CPU sets of the processes whose title starts with ``title`` (Ray names an actor's
    process ``ray::CLASS...``): where the kernel lets them run."""
    found = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            line = (proc / "cmdline").read_bytes() if proc.name.isdigit() else b""
            if line.replace(b"\0", b" ").split(b" ")[0] == title.encode():
                found.append(sorted(os.sched_getaffinity(int(proc.name))))
    return sorted(found)


@contextlib.contextmanager
def on_ray(args: argparse.Namespace, label: str, routing: str,
           serve_options: dict[str, Any] | None = None,
           app_options: dict[str, Any] | None = None) -> Iterator[str]:
    """service/ray_app.py on a fresh local cluster (a head with the proxy and no CPU for
    engines, one node a replica); yields the proxy's URL once every replica is ready."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from service.ray_app import build_app

    # One proxy for several nodes: without this Serve sends every request to a replica on
    # the proxy's own node while that one has room (as tests/service/ray_cluster.py says).
    os.environ["RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING"] = "0"
    with affinity(args.other_cpus):
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "resources": {INGRESS_RESOURCE: 1}})
    with affinity(args.engine_cpus):
        for _ in range(args.replicas):
            cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        serve.start(proxy_location="HeadOnly",
                    http_options={"host": "127.0.0.1", "port": port})
        app = build_app({"serve": {"model": str(args.artifact.resolve()), "intra_op_threads": 1,
                                   "max_batch_size": 32, "log_level": "warning",
                                   **(serve_options or {})},
                         "min_replicas": args.replicas, "max_replicas": args.replicas,
                         "max_replicas_per_node": 1, "num_cpus": 1,
                         "adapter_routing": routing,
                         "router_resources": {INGRESS_RESOURCE: 0.01}, **(app_options or {})})
        serve.run(app, name="attnserve", route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{port}"
        replicas_ready(url, args.replicas)
        actor = "ray::ServeReplica:attnserve:"
        print(json.dumps({label: {"replica_cpus": placed(actor + "attnserve"),
                                  "router_cpus": placed(actor + "attnserve-router"),
                                  "proxy_cpus": placed("ray::ProxyActor")}}), flush=True)
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def through_ray(args: argparse.Namespace, out: Path, label: str, routing: str) -> float:
    with on_ray(args, label, routing) as url:
        run = load(url, args, args.clients, args.requests, label, out, args.other_cpus)
        return finish([run], [label], out)[0]


async def completion(client: aiohttp.ClientSession, req: SampleRequest,
                     out: RequestOutput) -> RequestOutput:
    """A short OpenAI completion, not streamed, naming ``req.adapter``."""
    return await post(client, "/v1/completions", {
        "model": req.adapter, "prompt": req.prompt, "max_tokens": req.expected_output_len,
        "temperature": 0}, out)


def adapter_requests(url: str, names: list[str], count: int, clients: int,
                     new_tokens: int) -> list[tuple[int, str, str]]:
    """One OpenAI completion for each adapter alone (the warm-up: the replica it reaches
    loads it), then ``count`` naming them in turn (request i: names[i % n]), ``clients`` at
    a time; (i, adapter, the replica that answered) of each, the warm-up's i negative."""
    ids = [*range(-len(names), 0), *range(count)]
    asked = [SampleRequest(f"Question {i}: what is", 0, new_tokens, adapter=names[i % len(names)])
             for i in ids]
    warm_up, _ = send_all(url, completion, asked[:len(names)], 1)
    rest, _ = send_all(url, completion, asked[len(names):], clients)
    served = []
    for i, req, out in zip(ids, asked, warm_up + rest, strict=True):
        if not out.success:
            raise SystemExit(f"ray-serve: adapter {req.adapter}: {out.error}")
        served.append((i, str(req.adapter), out.headers.get("x-attnserve-replica", "")))
    return sorted(served)


def adapter_landing(args: argparse.Namespace, label: str) -> dict[str, Any]:
    """Adapters named in the body through the router: per adapter, the replicas that served
    it, and after the warm-up (one request each, alone) the share of its requests sent to a
    replica that had served it before, so holds it (each replica keeps every adapter it
    loads: ``max_adapters_per_replica`` is the adapters' count)."""
    names = sorted(p.name for p in args.adapters.iterdir() if p.is_dir())
    if not names:
        raise SystemExit(f"ray-serve: --adapters {args.adapters} holds no adapter directory")
    serve_options = {"max_loras": len(names), "max_lora_rank": max_rank(args.adapters, names),
                     "runtime_lora": True, "lora_dir": str(args.adapters.resolve())}
    with on_ray(args, label, "body", serve_options,
                {"max_adapters_per_replica": len(names)}) as url:
        served = adapter_requests(url, names, args.adapter_requests, args.clients, 16)
    return landing(served, names)


def landing(served: list[tuple[int, str, str]], names: list[str]) -> dict[str, Any]:
    """From (i, adapter, replica) in request order, the warm-up's i negative: the replicas
    each adapter was served by, and the share of requests i >= 0 whose replica had served
    that adapter before."""
    seen: dict[str, list[str]] = {name: [] for name in names}  # replicas, in request order
    hits = 0
    for i, name, replica in served:
        hits += i >= 0 and replica in seen[name]
        seen[name].append(replica)
    measured = sum(i >= 0 for i, _, _ in served)
    return {"adapters": len(names), "requests_after_warmup": measured,
            "replicas_per_adapter": {n: len(set(r)) for n, r in seen.items()},
            "landing_on_holder": round(hits / measured, 3) if measured else None}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks ray-serve",
                                     description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--artifact", type=Path, default=Path("artifacts/smollm2-135m-instruct"))
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=48, help="a round's, over all clients")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"of {', '.join(ARMS)}")
    parser.add_argument("--engine-cpus", type=cpus, help="e.g. 1: the engines' CPUs")
    parser.add_argument("--other-cpus", type=cpus, help="e.g. 0: everything else's")
    parser.add_argument("--adapters", type=Path,
                        help="ray-adapters: a directory of PEFT adapters (python -m benchmarks "
                             "lora-adapters --model ARTIFACT --out DIR --count 4)")
    parser.add_argument("--adapter-requests", type=int, default=96)
    parser.add_argument("--work", type=Path, help="the runs' logs and results (a temp dir)")
    parser.add_argument("--out", type=Path, help="the rounds and ratios as JSON")
    args = parser.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    if not arms or any(a not in ARMS for a in arms):
        parser.error(f"--arms {args.arms}: of {', '.join(ARMS)}")
    if "ray-adapters" in arms and (args.adapters is None or not args.adapters.is_dir()):
        parser.error("--arms ray-adapters needs --adapters DIR (a directory of PEFT adapters)")
    if (args.engine_cpus is None) != (args.other_cpus is None):
        parser.error("--engine-cpus and --other-cpus go together")
    if "direct" in arms and (args.clients % args.replicas or args.requests % args.replicas):
        parser.error("direct: --clients and --requests must split evenly over --replicas")
    if not (args.artifact / "manifest.json").is_file():
        parser.error(f"--artifact {args.artifact}: no manifest.json (make artifact)")
    work = args.work or Path(tempfile.mkdtemp(prefix="attnserve-ray-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    rounds: list[dict[str, Any]] = []
    for number in range(1, args.rounds + 1):
        row: dict[str, Any] = {"round": number}
        for arm in arms:
            label = f"{arm}-r{number}"
            row[arm] = (direct(args, work, label) if arm == "direct"
                        else adapter_landing(args, label) if arm == "ray-adapters"
                        else through_ray(args, work, label, arm.removeprefix("ray-")))
        for arm in (a for a in ("ray-header", "ray-body") if a in arms and "direct" in arms):
            row[f"{arm}/direct"] = round(row[arm] / row["direct"], 3)
        print(json.dumps(row), flush=True)
        rounds.append(row)
    ratios = {key: statistics.median(r[key] for r in rounds)
              for key in rounds[0] if key.endswith("/direct")}  # tokens/s through Serve ÷ direct
    emit({"config": {k: (sorted(v) if isinstance(v, set) else str(v) if isinstance(v, Path)
                         else v) for k, v in vars(args).items()},
          "work": str(work), "rounds": rounds, "median_ratios": ratios}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
