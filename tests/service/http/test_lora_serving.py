"""LoRA adapters on a live server (torch hidden).

Without adapters (runs now): /v1/models lists the base alone, an unknown ``model`` or
``adapter_id`` is a 404, and the run-time routes do not exist. With adapters (the
``lora_graph`` tests): they need an artifact with the adapter graph
(``engine_mixed_lora.onnx``) and skip while the tiny artifact has none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.contract import adapter_spec
from tests.service.helpers import ServerProcess, metric_value, serving, write_peft_adapter

ADAPTER_GRAPH = adapter_spec.lora_file("engine_mixed.onnx")


@pytest.fixture(scope="module")
def plain(start_server: Callable[..., ServerProcess]) -> Iterator[httpx.Client]:
    server = start_server("--served-model-name", "tiny")
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def test_a_server_without_adapters_lists_the_base_alone(plain: httpx.Client) -> None:
    cards = plain.get("/v1/models").json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [("tiny", None)]
    assert plain.get("/v1/models/tiny").status_code == 200


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": "sql", "prompt": "ab"}),
    ("/v1/chat/completions", {"model": "sql", "messages": [{"role": "user", "content": "a"}],
                              "stream": True}),
])
def test_a_server_without_adapters_answers_an_adapter_model_404(
        plain: httpx.Client, path: str, body: dict[str, Any]) -> None:
    r = plain.post(path, json=body)
    assert r.status_code == 404, r.text
    assert r.json()["error"] == {"message": "The model `sql` does not exist.",
                                 "type": "NotFoundError", "param": "model",
                                 "code": "model_not_found"}


@pytest.mark.parametrize("path,body", [
    ("/generate", {"inputs": "ab", "parameters": {"adapter_id": "sql"}}),
    ("/generate_stream", {"inputs": "ab", "parameters": {"adapter_id": "sql"}}),
    ("/", {"inputs": "ab", "parameters": {"adapter_id": "sql"}, "stream": True}),
    ("/attention", {"inputs": "ab", "adapter_id": "sql"}),
    ("/tokenize", {"inputs": "ab", "parameters": {"adapter_id": "sql"}}),
])
def test_a_server_without_adapters_answers_an_adapter_id_404(
        plain: httpx.Client, path: str, body: dict[str, Any]) -> None:
    r = plain.post(path, json=body)
    assert r.status_code == 404, r.text
    assert r.json()["error_type"] == "not_found"


def test_without_runtime_lora_the_load_routes_are_404(plain: httpx.Client) -> None:
    r = plain.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp"})
    assert r.status_code == 404
    assert plain.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 404


# -- with the adapter graph ------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_artifact(artifact: Path) -> Path:
    if not (artifact / ADAPTER_GRAPH).exists():
        pytest.skip(f"the tiny artifact has no adapter graph ({ADAPTER_GRAPH}): adapters "
                    "are served once export writes it")
    return artifact


@pytest.fixture(scope="module")
def widths(lora_artifact: Path) -> dict[str, tuple[int, int]]:
    """Module → (in, out) of every module the adapter graph takes."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(lora_artifact / ADAPTER_GRAPH),
                                   providers=["CPUExecutionProvider"])
    shapes = {i.name: i.shape for i in session.get_inputs()}
    modules = adapter_spec.adapter_modules(list(shapes))
    return {m: (int(shapes[adapter_spec.lora_a(m)][1]), int(shapes[adapter_spec.lora_b(m)][1]))
            for m in modules}


@pytest.fixture(scope="module")
def adapters_dir(widths: dict[str, tuple[int, int]],
                 tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora")
    write_peft_adapter(root / "zero", widths)  # B = 0: the base's outputs exactly
    write_peft_adapter(root / "loud", widths, b_value=0.5)
    write_peft_adapter(root / "later", widths, b_value=0.25)
    return root


@pytest.fixture(scope="module")
def lora_server(lora_artifact: Path, adapters_dir: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from serving(lora_artifact, tmp_path_factory.mktemp("lora-server") / "server.log",
                       ("--served-model-name", "tiny", "--device", "cpu", "--max-loras", "2",
                        "--lora-modules", f"zero={adapters_dir / 'zero'}",
                        f"loud={adapters_dir / 'loud'}", "--runtime-lora",
                        "--lora-dir", str(adapters_dir)))


@pytest.fixture(scope="module")
def lora(lora_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=lora_server.url, timeout=60) as client:
        yield client


def greedy(client: httpx.Client, model: str, prompt: str = "ROMEO:") -> str:
    r = client.post("/v1/completions", json={"model": model, "prompt": prompt,
                                              "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    return str(r.json()["choices"][0]["text"])


@pytest.mark.lora_graph
def test_served_adapters_are_listed_and_chosen_by_model_and_adapter_id(
        lora: httpx.Client, adapters_dir: Path) -> None:
    cards = lora.get("/v1/models").json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [
        ("tiny", None), ("zero", "tiny"), ("loud", "tiny")]
    base = greedy(lora, "tiny")
    assert greedy(lora, "zero") == base  # B = 0 changes nothing
    tgi = lora.post("/generate", json={"inputs": "ROMEO:", "parameters": {
        "adapter_id": "zero", "max_new_tokens": 12}}).json()["generated_text"]
    assert tgi == base
    greedy(lora, "loud")  # runs (its text may or may not differ on the tiny model)
    metrics = lora.get("/metrics").text
    assert metric_value(metrics, "attnserve_lora_requests_total", {"adapter": "zero"}) == 2
    assert metric_value(metrics, "attnserve_lora_loads_total", {"adapter": "zero"}) >= 1


@pytest.mark.lora_graph
def test_an_adapter_loaded_at_run_time_serves_until_unloaded(lora: httpx.Client) -> None:
    r = lora.post("/v1/load_lora_adapter", json={"lora_name": "later", "lora_path": "later"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'later' added successfully."
    greedy(lora, "later")
    # three adapters over two slots: one is evicted for another
    for model in ("zero", "loud", "later"):
        greedy(lora, model)
    assert metric_value(lora.get("/metrics").text, "attnserve_lora_evictions_total",
                        {"adapter": "zero"}) >= 1
    r = lora.post("/v1/unload_lora_adapter", json={"lora_name": "later"})
    assert r.status_code == 200, r.text
    assert lora.post("/v1/completions", json={"model": "later", "prompt": "a"}
                     ).status_code == 404
