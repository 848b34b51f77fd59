"""attnserve on Ray Serve under load on a local two-node cluster: autoscaling adds a
replica while requests outnumber the target and removes it when idle; a node killed under
load leaves the deployment serving on the other, the clients' retried requests succeed, no
answer is wrong (each equal to the plain model.onnx greedy loop); a node added back takes a
replica again. And deploy/ray/serve.yaml is a valid Serve config whose args build the app.

Skipped with its reason where Ray is not installed (``pip install .[ray]``) or cannot start.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install .[ray]")
serve = pytest.importorskip("ray.serve")

from service.ray_app import NODE_HEADER, RayServeArgs, build_app  # noqa: E402
from tests.service.ray_cluster import serving_on_ray, wait_until  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["ROMEO:", "First Citizen:", "To be, or not", "What say you"]


def test_the_deploy_config_is_a_valid_serve_config_that_builds() -> None:
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load((REPO / "deploy" / "ray" / "serve.yaml").read_text())
    schema = ServeDeploySchema.model_validate(config)
    (app,) = schema.applications
    assert app.import_path == "service.ray_app:build_app"
    args = RayServeArgs.model_validate(app.args)
    assert args.min_replicas <= args.max_replicas
    assert build_app(app.args) is not None
    with pytest.raises(ValueError, match="max_replicas"):
        RayServeArgs.model_validate({**app.args, "max_replicas": 0})


def test_the_router_reads_the_adapter_where_each_api_names_it() -> None:
    """OpenAI: ``model`` unless it is the base model's name; TGI: ``parameters.adapter_id``;
    anything else (other routes, no JSON, no name) goes to the replicas as the base's."""
    from service.ray_app import adapter_named

    def body(value: object) -> bytes:
        return json.dumps(value).encode()

    for path in ("/v1/completions", "/v1/chat/completions"):
        assert adapter_named(path, body({"model": "alpha", "prompt": "x"}), "tiny") == "alpha"
        assert adapter_named(path, body({"model": "tiny", "prompt": "x"}), "tiny") == ""
        assert adapter_named(path, body({"prompt": "x"}), "tiny") == ""
    for path in ("/generate", "/generate_stream", "/"):
        assert adapter_named(path, body({"inputs": "x", "parameters": {"adapter_id": "beta"}}),
                             "tiny") == "beta"
        assert adapter_named(path, body({"inputs": "x", "parameters": {}}), "tiny") == ""
        assert adapter_named(path, body({"inputs": "x"}), "tiny") == ""
    assert adapter_named("/v1/completions", b"not json", "tiny") == ""
    assert adapter_named("/v1/completions", body(["alpha"]), "tiny") == ""
    assert adapter_named("/attention", body({"model": "alpha"}), "tiny") == ""


@dataclass
class Cluster:
    url: str
    cluster: Any
    worker: Any  # the second node
    answers: Callable[[str, list[int]], bool] = field(repr=False, default=lambda *_: True)


def replicas_running() -> int:
    status = serve.status().applications["attnserve"].deployments["attnserve"]
    return int(status.replica_states.get("RUNNING", 0))


@pytest.fixture(scope="module")
def scaling(artifact: Path, reference_greedy: Callable[[list[int], int], list[int]],
            encode: Callable[[str], list[int]]) -> Iterator[Cluster]:
    def right(prompt: str, tokens: list[int]) -> bool:
        return tokens == reference_greedy(encode(prompt), len(tokens))

    with serving_on_ray({
            "serve": {"model": str(artifact), "device": "cpu", "intra_op_threads": 1},
            "min_replicas": 1, "max_replicas": 2, "max_replicas_per_node": 1,
            "target_ongoing_requests": 1, "upscale_delay_s": 0, "downscale_delay_s": 2,
            "num_cpus": 1}, head_cpus=1, worker_cpus=[1]) as local:
        wait_until(lambda: _ready(local.url), "the first replica ready")
        yield Cluster(local.url, local.cluster, local.workers[0], right)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=10).status_code == 200
    except httpx.TransportError:
        return False


class Load:
    """Clients sending greedy requests in a loop until stopped; a request that fails (its
    replica's node died, a replica still loading) is retried, at most 20 times."""

    def __init__(self, c: Cluster, clients: int) -> None:
        self.c, self.stop = c, threading.Event()
        self.done: list[tuple[str, list[int], str]] = []
        self.failures: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(i,)) for i in range(clients)]
        for t in self.threads:
            t.start()

    def _client(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            prompt = PROMPTS[(i + n) % len(PROMPTS)]
            n += 1
            for _ in range(20):
                try:
                    r = httpx.post(f"{self.c.url}/generate", timeout=60, json={
                        "inputs": prompt, "parameters": {"max_new_tokens": 24,
                                                         "details": True}})
                except httpx.TransportError as exc:
                    error = f"{type(exc).__name__}"
                else:
                    if r.status_code == 200:
                        tokens = [t["id"] for t in r.json()["details"]["tokens"]]
                        with self.lock:
                            self.done.append((prompt, tokens, r.headers[NODE_HEADER]))
                        break
                    error = f"{r.status_code}"
                with self.lock:
                    self.failures.append(error)
            else:
                with self.lock:
                    self.failures.append(f"gave up on {prompt!r}")

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)


def test_autoscaling_and_a_node_killed_under_load(scaling: Cluster) -> None:
    """One load, both claims (each scale-up costs a replica's start): a second replica is
    added under load; the worker node killed, the deployment serves on the head, retried
    requests succeed and no answer is wrong; the node added back takes a replica again;
    idle, the deployment is back to one replica."""
    wait_until(lambda: replicas_running() == 1, "one replica when idle")
    load = Load(scaling, clients=4)
    try:
        wait_until(lambda: replicas_running() == 2, "a second replica under load")
        wait_until(lambda: len({n for *_, n in load.done}) == 2, "both nodes answering")
        before = len(load.done)
        scaling.cluster.remove_node(scaling.worker)  # its raylet and replica die at once
        wait_until(lambda: len(load.done) >= before + 8, "answers after the node died")
        scaling.worker = scaling.cluster.add_node(num_cpus=1)
        wait_until(lambda: replicas_running() == 2, "a replica on the node added back")
        nodes_after = {n for *_, n in load.done[before + 8:]}
    finally:
        load.finish()
    assert not [f for f in load.failures if f.startswith("gave up")], load.failures
    assert all(scaling.answers(p, t) for p, t, _ in load.done)  # 0 wrong answers
    assert nodes_after  # served throughout
    wait_until(lambda: replicas_running() == 1, "back to one replica when idle")
