"""What an inference gateway's endpoint picker reads from /metrics (Kubernetes Gateway API
Inference Extension's model-server protocol), parsed as it parses them: Prometheus text
through prometheus_client's parser; the LoRA info gauge's one series, the latest by its
value, its adapter lists split on commas; the KV-cache fraction in [0, 1]; the cache
config's block size and block count.

On its own (the metrics over an AdapterSet whose requests are placed by hand) and on a live
server whose engine a step gate holds, so that one adapter's request runs while another's
waits for the only slot.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.engine.adapters import AdapterLimits, AdapterSet, AdapterSlots
from service.engine.stats import KVStats, LoadStats
from service.http.metrics import Metrics
from tests.service.engine.test_adapters import MODULES, write_adapter
from tests.service.helpers import ServerProcess, gated_serving, metric_value, wait_metric
from tests.service.lora_build import LoraBuild

LORA_INFO = "attnserve_lora_requests_info"
CACHE_INFO = "attnserve_cache_config_info"


def picker_view(text: str) -> dict[str, Any]:
    """The four gauges and the two info series as the endpoint picker takes them: the
    LoRA info series with the largest value (its "last updated" time), names split on
    commas with empty names dropped."""
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    lora = [s for s in samples if s.name == LORA_INFO]
    cache = [s for s in samples if s.name == CACHE_INFO]
    view: dict[str, Any] = {
        "waiting": metric_value(text, "attnserve_num_requests_waiting"),
        "running": metric_value(text, "attnserve_num_requests_running"),
        "kv": metric_value(text, "attnserve_kv_cache_usage_perc"),
        "lora_series": len(lora), "cache": [s.labels for s in cache]}
    if lora:
        latest = max(lora, key=lambda s: s.value)
        view["lora"] = {
            "max": int(latest.labels["max_lora"]), "value": latest.value,
            **{key: [n for n in latest.labels[f"{key}_lora_adapters"].split(",") if n]
               for key in ("running", "waiting")}}
    return view


def test_the_lora_info_series_follows_the_adapters_requests(tmp_path: Path) -> None:
    """One slot, three adapters: a's request admitted, b's waiting for the slot, c idle;
    then a leaves and b runs. Exactly one series every scrape; its value the scrape time."""
    metrics = Metrics()
    adapters = AdapterSet(AdapterSlots(MODULES, AdapterLimits(max_loras=1, max_lora_rank=8)))
    for i, name in enumerate("abc"):
        write_adapter(tmp_path / name, 4, seed=i)
        adapters.add(adapters.read(tmp_path / name, name))
    metrics.lora_info.clock = iter([100.0, 101.0, 102.0]).__next__
    metrics.watch_adapters(adapters)

    def lora() -> dict[str, Any]:
        view = picker_view(metrics.render()[0].decode())
        assert view["lora_series"] == 1
        return dict(view["lora"])

    assert lora() == {"max": 1, "value": 100.0, "running": [], "waiting": []}
    a, b = adapters.begin("a"), adapters.begin("b")
    assert adapters.acquire(a) and not adapters.acquire(b)
    assert lora() == {"max": 1, "value": 101.0, "running": ["a"], "waiting": ["b"]}
    adapters.release(a)
    adapters.end(a)
    assert adapters.acquire(b)
    assert lora() == {"max": 1, "value": 102.0, "running": ["b"], "waiting": []}


def test_a_server_without_adapters_has_no_lora_series_and_its_kv_fraction_is_bounded() -> None:
    metrics = Metrics()
    metrics.record_load(LoadStats(running=2, waiting=3, kv=KVStats(
        tokens=96, slots=4, slots_used=2, capacity_tokens=128, bytes_allocated=0)))
    metrics.set_cache_config(block_size=16, blocks=40)
    view = picker_view(metrics.render()[0].decode())
    assert view == {"waiting": 3.0, "running": 2.0, "kv": 0.75, "lora_series": 0,
                    "cache": [{"block_size": "16", "num_gpu_blocks": "40"}]}


@pytest.fixture(scope="module")
def held(lora_build: LoraBuild, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[ServerProcess]:
    """The tiny Llama with two adapters over ONE slot, prefix caching in blocks of 4, behind
    a step gate (open until a test holds it)."""
    alpha, beta = lora_build.adapters["alpha"], lora_build.adapters["beta"]
    yield from gated_serving(
        lora_build.artifact, tmp_path_factory.mktemp("gateway-metrics") / "server.log",
        ("--served-model-name", "tiny", "--device", "cpu", "--max-loras", "1",
         "--max-lora-rank", "8", "--lora-modules", f"alpha={alpha}", f"beta={beta}",
         "--prefix-block-size", "4"))


def test_a_live_servers_gauges_while_one_adapter_runs_and_another_waits(
        held: ServerProcess) -> None:
    def scrape() -> dict[str, Any]:
        return picker_view(httpx.get(f"{held.url}/metrics").text)

    idle = scrape()
    assert idle["lora_series"] == 1
    assert idle["lora"] | {"value": 0} == {"max": 1, "value": 0, "running": [], "waiting": []}
    assert len(idle["cache"]) == 1 and idle["cache"][0]["block_size"] == "4"
    assert int(idle["cache"][0]["num_gpu_blocks"]) > 0

    gate = held.gate
    assert gate is not None

    def generate(adapter: str) -> int:
        r = httpx.post(f"{held.url}/generate", timeout=120, json={
            "inputs": "ROMEO:", "parameters": {"adapter_id": adapter, "max_new_tokens": 4}})
        return r.status_code

    with ThreadPoolExecutor(2) as pool:
        gate.send("-")
        try:
            alpha = pool.submit(generate, "alpha")
            gate.send(".")  # its prefill; its first decode step waits at the gate
            wait_metric(held, "attnserve_num_requests_running", 1)
            beta = pool.submit(generate, "beta")  # the only slot is alpha's: beta waits
            wait_metric(held, "attnserve_num_requests_waiting", 1)
            busy = scrape()
        finally:
            gate.send("+")
        assert alpha.result() == 200 and beta.result() == 200
    assert busy["lora"] | {"value": 0} == {
        "max": 1, "value": 0, "running": ["alpha"], "waiting": ["beta"]}
    assert busy["lora"]["value"] >= idle["lora"]["value"]
    assert 0.0 < busy["kv"] <= 1.0  # alpha's prompt and first token hold KV
    wait_metric(held, "attnserve_num_requests_running", 0)
    done = scrape()
    assert done["lora"]["running"] == [] and done["lora"]["waiting"] == []
    assert 0.0 <= done["kv"] <= 1.0
