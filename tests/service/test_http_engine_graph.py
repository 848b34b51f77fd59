"""The production CPU path over HTTP: an artifact exported with --engine-graph.

`make run` and the CPU image export engine.onnx (GroupQueryAttention, KV cache updated in
place); the server must pick it, say so in /info, and still give, for concurrent requests
that share decode steps, exactly the greedy tokens of the plain model.onnx reference loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from service.contract.engine_spec import ENGINE_FILE
from service.contract.manifest import verify_manifest
from tests.service.conftest import ServerProcess

PROMPTS = ["ROMEO:", "First Citizen:\nBefore we proceed any further", "To be",
           "What say you, my good lord? I pray", "O", "KING HENRY:"]


@pytest.fixture(scope="module")
def engine_artifact(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from export.to_onnx import export_artifact

    out = tmp_path_factory.mktemp("engine-http") / "artifact"
    return export_artifact(tiny_checkpoint, out, engine_graph=True, optimize=False)


@pytest.fixture(scope="module")
def server(engine_artifact: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    proc = ServerProcess(engine_artifact, tmp_path_factory.mktemp("log") / "server.log")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def test_manifest_lists_the_engine_graph(engine_artifact: Path) -> None:
    assert ENGINE_FILE in verify_manifest(engine_artifact).files


def test_server_decodes_with_the_engine_graph(server: ServerProcess) -> None:
    info = httpx.get(f"{server.url}/info", timeout=10).json()
    assert info["decode_graph"] == ENGINE_FILE


def test_concurrent_greedy_requests_equal_the_reference_loop(
        server: ServerProcess, encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    lengths = [20, 7, 33, 12, 26, 15]  # rows leave the batch at different steps

    def generate(i: int) -> list[int]:
        r = httpx.post(f"{server.url}/generate", timeout=60, json={
            "inputs": PROMPTS[i], "parameters": {"max_new_tokens": lengths[i], "details": True}})
        assert r.status_code == 200, r.text
        return [t["id"] for t in r.json()["details"]["tokens"]]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(generate, range(len(PROMPTS))))
    for i, prompt in enumerate(PROMPTS):
        assert got[i] == reference_greedy(encode(prompt), lengths[i]), prompt
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    batched = [line for line in metrics.splitlines()
               if line.startswith('attnserve_batch_size_bucket{le="1.0"}')]
    total = [line for line in metrics.splitlines()
             if line.startswith("attnserve_batch_size_count")]
    assert batched and total
    assert float(total[0].split()[-1]) > float(batched[0].split()[-1])  # steps with >1 row
