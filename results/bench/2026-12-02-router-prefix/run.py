"""The compose `scale` profile (3 replicas, 1 ONNX Runtime thread each) on a Docker daemon of
the tests' own (tests/deploy/docker_harness.py: the images `make images` built), then
benchmarks/router_prefix.py through HAProxy's prefix hash and by client round robin.

Usage (root, repository root, after the compose tests or `make images` built the images):
    PYTHONPATH=. python results/bench/2026-12-02-router-prefix/run.py [router_prefix options...]
"""
import sys
from pathlib import Path

from benchmarks import router_prefix
from tests.deploy.docker_harness import Compose, free_port_range, start_daemon, stop_daemon

OUT = Path(__file__).resolve().parent / "router_prefix.json"
daemon = start_daemon(None)
try:
    first = free_port_range(4)
    compose = Compose(daemon, "attnserve-router-bench", {
        "ATTNSERVE_MODEL_DIR": str(Path("artifacts/smollm2-135m-instruct").resolve()),
        "ATTNSERVE_INTRA_OP_THREADS": "1", "ATTNSERVE_HOST_PORTS": f"{first}-{first + 3}",
        "PROXY_HOST_PORT": str(free_port_range(1)),
        "PROMETHEUS_HOST_PORT": str(free_port_range(1))}, profiles=("scale",))
    compose.down()
    try:
        compose.up("-d", "--no-build", "--scale", "attnserve=3", timeout=420)
        compose.wait_healthy("attnserve", 3, 300)
        replicas = [f"http://127.0.0.1:{compose.host_port(c)}"
                    for c in compose.containers("attnserve")]
        router = f"http://127.0.0.1:{compose.settings['PROXY_HOST_PORT']}"
        router_prefix.main(["--router", router, "--replicas", *replicas, "--out", str(OUT),
                            *sys.argv[1:]])
    finally:
        compose.down()
finally:
    stop_daemon(daemon)
