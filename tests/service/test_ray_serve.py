"""attnserve on Ray Serve (service/ray_app.py) on a local two-node Ray cluster
(``ray.cluster_utils.Cluster``: two raylets on this machine, one replica each): requests
sent at once through Serve's proxy, base and adapters, each equal to its merged model's
greedy tokens alone (tests/service/lora_build.py, the plain model.onnx loop); both nodes
serve; an adapter named by Serve's multiplexing header, or only in the body as on one server
(OpenAI ``model``, TGI ``adapter_id``: read by the router ingress), is loaded by the replica
its first request reaches, and later requests for it go to a replica that holds it.

Skipped with its reason where Ray is not installed (``pip install .[ray]``) or cannot start.
"""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.service.lora_build import LoraBuild, merged_greedy

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install .[ray]")
serve = pytest.importorskip("ray.serve")

from service.ray_app import NODE_HEADER, REPLICA_HEADER  # noqa: E402
from tests.service.ray_cluster import serving_on_ray, wait_until  # noqa: E402

MULTIPLEXED = "serve_multiplexed_model_id"
PROMPTS = ["ROMEO:", "First Citizen:", "To be, or not", "What say you", "O", "Hark"]


@dataclass
class Deployed:
    url: str
    build: LoraBuild


@pytest.fixture(scope="module")
def deployed(lora_build: LoraBuild, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[Deployed]:
    root = tmp_path_factory.mktemp("ray-lora-dir")
    for name, directory in lora_build.adapters.items():
        shutil.copytree(directory, root / name)
    with serving_on_ray({
            "serve": {"model": str(lora_build.artifact), "device": "cpu",
                      "intra_op_threads": 1, "max_loras": 2, "max_lora_rank": 8,
                      "runtime_lora": True, "lora_dir": str(root),
                      "served_model_name": "tiny"},
            "min_replicas": 2, "max_replicas": 2, "max_replicas_per_node": 1,
            "max_adapters_per_replica": 2, "num_cpus": 1}, head_cpus=1, worker_cpus=[1]
    ) as local:
        wait_both_ready(local.url)
        yield Deployed(local.url, lora_build)


def wait_both_ready(url: str) -> None:
    """Until /ready has answered 200 from two replicas on two nodes."""
    ready: set[tuple[str, str]] = set()

    def another_ready() -> bool:
        try:
            r = httpx.get(f"{url}/ready", timeout=10)
        except httpx.TransportError:
            return False  # the application is not routed yet
        if r.status_code == 200:
            ready.add((r.headers[REPLICA_HEADER], r.headers[NODE_HEADER]))
        return len(ready) == 2

    wait_until(another_ready, "two replicas ready")
    assert len({node for _, node in ready}) == 2


def generate(url: str, prompt: str, adapter: str = "", multiplexed: bool = False,
             new: int = 8) -> tuple[list[int], list[int], httpx.Headers]:
    parameters: dict[str, Any] = {"max_new_tokens": new, "details": True,
                                  "decoder_input_details": True}
    if adapter:
        parameters["adapter_id"] = adapter
    headers = {MULTIPLEXED: adapter} if multiplexed and adapter else {}
    r = httpx.post(f"{url}/generate", json={"inputs": prompt, "parameters": parameters},
                   headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    details = r.json()["details"]
    return ([t["id"] for t in details["prefill"]], [t["id"] for t in details["tokens"]],
            r.headers)


def test_requests_at_once_through_serve_equal_one_model_alone_and_both_nodes_serve(
        deployed: Deployed) -> None:
    with ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
        answers = list(pool.map(lambda p: generate(deployed.url, p), PROMPTS * 2))
    compared = 0
    for prompt_ids, got, _ in answers:
        want = merged_greedy(deployed.build, "", prompt_ids, 8)
        assert got[:len(want)] == want
        compared += len(want)
    assert compared >= 4 * len(answers)
    assert len({h[NODE_HEADER] for _, _, h in answers}) == 2  # both replicas took requests


def test_openai_streaming_passes_through_serves_proxy(deployed: Deployed) -> None:
    with httpx.stream("POST", f"{deployed.url}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": "ROMEO:", "max_tokens": 6, "temperature": 0,
            "stream": True}) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3


def test_adapters_are_loaded_where_asked_and_later_requests_go_there(
        deployed: Deployed) -> None:
    """Each adapter's first request loads it on the replica it reaches; of the later ones,
    at least 90 % go to a replica that loaded it, and every answer is its merged model's."""
    holders: dict[str, set[str]] = {}
    for adapter in ("alpha", "beta"):
        _, _, headers = generate(deployed.url, "O", adapter, multiplexed=True)
        holders[adapter] = {headers[REPLICA_HEADER]}
    asks = [(a, p) for p in PROMPTS for a in ("alpha", "beta")]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(
            lambda ask: generate(deployed.url, ask[1], ask[0], multiplexed=True), asks))
    landed: Counter[bool] = Counter()
    for (adapter, _), (prompt_ids, got, headers) in zip(asks, answers, strict=True):
        want = merged_greedy(deployed.build, adapter, prompt_ids, 8)
        assert got[:len(want)] == want, adapter
        replica = headers[REPLICA_HEADER]
        landed[replica in holders[adapter]] += 1
        holders[adapter].add(replica)  # a second replica may load it under load
    assert landed[True] >= 0.9 * len(asks), landed
    assert all(len(h) <= 2 for h in holders.values())


def test_an_adapter_not_under_lora_dir_is_a_404(deployed: Deployed) -> None:
    r = httpx.post(f"{deployed.url}/generate", timeout=60,
                   headers={MULTIPLEXED: "nowhere"},
                   json={"inputs": "O", "parameters": {"adapter_id": "nowhere"}})
    assert r.status_code == 404, r.text
    assert "nowhere" in r.json()["error"]


def test_adapters_named_in_the_body_alone_are_routed_to_their_replicas(
        deployed: Deployed) -> None:
    """No header: the router reads TGI's adapter_id and OpenAI's model. Later requests land
    on a replica holding their adapter (≥ 90 %), every TGI answer is its merged model's, and
    an OpenAI request naming an adapter is served under it."""
    holders: dict[str, set[str]] = {}
    for adapter in ("alpha", "beta"):
        _, _, headers = generate(deployed.url, "Hark", adapter)
        holders[adapter] = {headers[REPLICA_HEADER]}
    asks = [(a, p) for p in PROMPTS for a in ("alpha", "beta")]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda ask: generate(deployed.url, ask[1], ask[0]), asks))
    landed: Counter[bool] = Counter()
    for (adapter, _), (prompt_ids, got, headers) in zip(asks, answers, strict=True):
        want = merged_greedy(deployed.build, adapter, prompt_ids, 8)
        assert got[:len(want)] == want, adapter
        landed[headers[REPLICA_HEADER] in holders[adapter]] += 1
        holders[adapter].add(headers[REPLICA_HEADER])
    assert landed[True] >= 0.9 * len(asks), landed
    for adapter in ("alpha", "beta"):
        r = httpx.post(f"{deployed.url}/v1/completions", timeout=120, json={
            "model": adapter, "prompt": "O", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        # served under the adapter: a replica reached without it loaded would answer 404
        assert r.json()["model"] == adapter


def generated_tokens(address: str) -> float:
    """attnserve_generation_tokens_total, scraped from one replica's own endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://{address}/metrics", timeout=30).text
    return sum(sample.value for family in text_string_to_metric_families(text)
               if family.name == "attnserve_generation_tokens"
               for sample in family.samples if sample.name.endswith("_total"))


def test_each_replica_serves_its_own_metrics_listed_for_prometheus(deployed: Deployed) -> None:
    """/metrics/replicas lists one target a replica (Prometheus' http_sd format, replica and
    node labels); a request's tokens are counted by the replica that served it alone."""
    targets: list[dict[str, Any]] = []

    def both_listed() -> bool:
        targets[:] = httpx.get(f"{deployed.url}/metrics/replicas", timeout=10).json()
        return len(targets) == 2

    wait_until(both_listed, "both replicas' metrics endpoints listed")
    by_replica = {t["labels"]["replica"]: t["targets"][0] for t in targets}
    assert len({t["labels"]["node"] for t in targets}) == 2
    before = {replica: generated_tokens(address) for replica, address in by_replica.items()}
    r = httpx.post(f"{deployed.url}/generate", timeout=120, json={
        "inputs": "ROMEO:", "parameters": {"max_new_tokens": 5, "details": True}})
    assert r.status_code == 200, r.text
    served, tokens = r.headers[REPLICA_HEADER], r.json()["details"]["generated_tokens"]
    after = {replica: generated_tokens(address) for replica, address in by_replica.items()}
    assert {replica: after[replica] - before[replica] for replica in by_replica} == {
        replica: (tokens if replica == served else 0) for replica in by_replica}
