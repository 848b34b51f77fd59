"""`docker-compose up` for real: the images built here, SmolLM2 mounted, Prometheus scraping.

What a user runs (docs/containers.md): `make images`, `make deploy-model`, `docker-compose up
-d`; here against a dockerd the tests start themselves (tests/deploy/docker_harness.py), on
free loopback ports. The stack is the default one: attnserve + Prometheus on a compose
network. The tests run in file order on one stack: the last two stop and restart it.

Skipped, loudly, where no dockerd can run (not root, docker.io not installed). The first run
on a machine builds the local Debian base (debootstrap, about two minutes) and the images;
later runs find them in the daemon's data root and only check them (seconds).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.deploy.docker_harness import (
    CHAT_MODEL,
    Compose,
    Stream,
    chat_body,
    free_port_range,
    post_json,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
START_S = 180.0  # container created → healthy (model load + warm-up: ~10 s when idle)
RUNTIME_UID = 10001


@dataclass
class Stack:
    compose: Compose
    url: str  # attnserve through its published port
    prometheus: str


@pytest.fixture(scope="module")
def stack(docker_daemon, deploy_images, deploy_model) -> Iterator[Stack]:
    first = free_port_range(3)
    prometheus_port = free_port_range(1)
    compose = Compose(docker_daemon, "attnserve-e2e", {
        "ATTNSERVE_MODEL_DIR": str(deploy_model),
        "ATTNSERVE_HOST_PORTS": f"{first}-{first + 2}",
        "PROMETHEUS_HOST_PORT": str(prometheus_port),
    })
    compose.down()
    try:
        compose.run("up", "-d", "--no-build", timeout=300)
        compose.wait_healthy("attnserve", 1, START_S)
        (container,) = compose.containers("attnserve")
        yield Stack(compose, f"http://127.0.0.1:{compose.host_port(container)}",
                    f"http://127.0.0.1:{prometheus_port}")
    finally:
        print("\n".join(compose.transcript))
        print(compose.logs())
        compose.down()


def test_serving_image_is_torch_free_non_root_and_carries_no_host_config(
        docker_daemon, deploy_images) -> None:
    image = json.loads(docker_daemon.docker("image", "inspect", "attnserve:cpu").stdout)[0]
    config = image["Config"]
    assert config["User"] == f"{RUNTIME_UID}:{RUNTIME_UID}"
    assert config["Healthcheck"]["Test"][0] == "CMD"
    assert not [e for e in config["Env"] if e.startswith(("PIP_", "REQUESTS_CA", "SSL_CERT"))]
    size_mb = image["Size"] / 1e6
    print(f"attnserve:cpu is {size_mb:.0f} MB; images ready in {deploy_images['seconds']:.0f} s")
    assert size_mb < 700, "torch alone would add ~750 MB"
    probe = ("import importlib.util as u, os, sys; import onnxruntime, service.http.app; "
             "assert u.find_spec('torch') is None, 'torch is installed'; "
             "assert not any(os.path.exists(p) for p in ('/wheels', '/etc/pip.conf', "
             "'/etc/xdg/pip/pip.conf')), 'build inputs left in the image'; print(os.getuid())")
    run = docker_daemon.docker("run", "--rm", "--network", "none", "attnserve:cpu",
                               "python", "-c", probe, timeout=120)
    assert run.stdout.strip() == str(RUNTIME_UID)


def test_service_is_healthy_non_root_with_the_model_mounted_read_only(stack, deploy_model
                                                                       ) -> None:
    (container,) = stack.compose.containers("attnserve")
    info = stack.compose.inspect(container)
    assert info["State"]["Health"]["Status"] == "healthy"
    (mount,) = [m for m in info["Mounts"] if m["Destination"] == "/models/default"]
    assert mount["RW"] is False and Path(mount["Source"]) == deploy_model.resolve()
    # every process of the container (the init and the server) runs as the image's user
    top = stack.compose.daemon.docker("top", container, "-eo", "pid,uid,args").stdout.splitlines()
    processes = [line.split(None, 2)[1:] for line in top[1:]]
    assert any("attnserve serve" in args for _, args in processes), top
    assert {uid for uid, _ in processes} == {str(RUNTIME_UID)}, top


def test_chat_through_the_published_port_is_answered_by_smollm2(stack) -> None:
    status, _, raw = post_json(f"{stack.url}/v1/chat/completions",
                               chat_body("What is the capital of France?", 32), timeout=60)
    assert status == 200, raw[:500]
    reply = json.loads(raw)
    assert reply["model"] == CHAT_MODEL
    assert "Paris" in reply["choices"][0]["message"]["content"], reply


def test_prometheus_in_its_container_scrapes_the_service_by_name(stack, smoke) -> None:
    # deploy/smoke.py is the check users run against their own stack: traffic, a scrape
    # after it, p50 time to first token from the histogram, every dashboard metric exposed.
    summary = smoke.check_deployment(stack.url, stack.prometheus, n_requests=3, timeout=90)
    assert summary["health"] == "up"
    assert math.isfinite(summary["ttft_p50_s"]) and summary["ttft_p50_s"] > 0
    targets = smoke.prometheus_api(stack.prometheus, "targets", state="active")["activeTargets"]
    (target,) = [t for t in targets if t["labels"]["job"] == "attnserve"]
    # found through compose's DNS by the service's name, scraped on the container port
    assert target["discoveredLabels"]["__meta_dns_name"] == "attnserve"
    assert target["scrapeUrl"].endswith(":8000/metrics")
    buckets = smoke.prometheus_api(
        stack.prometheus, "query",
        query="sum by (le) (attnserve_time_to_first_token_seconds_bucket)")["result"]
    assert {b["metric"]["le"] for b in buckets} >= {"+Inf"}
    assert float(next(b for b in buckets if b["metric"]["le"] == "+Inf")["value"][1]) >= 3


def test_compose_stop_drains_an_in_flight_stream(stack) -> None:
    # 96 tokens take a few seconds: well inside the 20 s drain of docker-compose.yml.
    stream = Stream(f"{stack.url}/v1/chat/completions",
                    chat_body("Tell me a story about a lighthouse.", 96, stream=True,
                              ignore_eos=True)).start()
    assert stream.first_chunk.wait(60), "no token within 60 s"
    (container,) = stack.compose.containers("attnserve")
    stack.compose.run("stop", timeout=120)  # SIGTERM to every service, Prometheus first
    events = stream.join(30)
    assert events and events[-1] == "[DONE]", events[-3:]
    chunks = [e for e in events[:-1] if "choices" in e]
    assert not [e for e in events[:-1] if "error" in e], events[-3:]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for c in chunks if c["choices"][0]["delta"].get("content")) >= 90
    state = stack.compose.inspect(container)["State"]
    assert (state["Status"], state["ExitCode"]) == ("exited", 0)
    logs = stack.compose.daemon.docker("logs", container)
    assert "signal SIGTERM: draining in-flight requests" in logs.stdout + logs.stderr


def test_restarted_service_serves_again_from_the_same_volume(stack, deploy_model) -> None:
    (container,) = stack.compose.containers("attnserve")
    stack.compose.run("start", timeout=120)
    (healthy,) = stack.compose.wait_healthy("attnserve", 1, START_S)
    assert healthy == container  # the same container, restarted, not a new one
    (mount,) = [m for m in stack.compose.inspect(container)["Mounts"]
                if m["Destination"] == "/models/default"]
    assert Path(mount["Source"]) == deploy_model.resolve() and mount["RW"] is False
    url = f"http://127.0.0.1:{stack.compose.host_port(container)}"

    def answered() -> dict | None:
        status, _, raw = post_json(f"{url}/v1/chat/completions",
                                   chat_body("What is the capital of France?", 32))
        return json.loads(raw) if status == 200 else None

    reply = wait_for(answered, 60, "a chat answer after the restart")
    assert "Paris" in reply["choices"][0]["message"]["content"]
