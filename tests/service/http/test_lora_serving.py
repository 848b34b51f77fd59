"""LoRA adapters on a live server (torch hidden).

Without adapters: /v1/models lists the base alone, an unknown ``model`` or ``adapter_id``
is a 404, and the run-time routes do not exist. With adapters (a tiny Llama and two PEFT
adapters, tests/service/lora_build.py): requests of the base and of each adapter, sent at
once, each answer as its merged model (`attnserve merge`) alone; an adapter loaded at run
time serves, adapters are evicted and placed again, and an unload waits for the request in
flight; /attention under an adapter and a control vector at once is the merged model's
attention.onnx under the vector's rows.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from service.contract import adapter_spec
from service.contract import io_spec as io
from service.contract.control_vector import ControlVector, write_control_vector
from tests.service.helpers import (
    ServerProcess,
    metric_value,
    serving,
    without_steer,
    write_peft_adapter,
)
from tests.service.lora_build import LoraBuild, merged_greedy

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
    assert not any(g["adapters"] for g in plain.get("/info").json()["graphs"])


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


# -- with adapters: every answer against its merged model -------------------------------------


@pytest.fixture(scope="module")
def lora_root(lora_build: LoraBuild, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """--lora-dir: the two PEFT adapters, and "zero" (B = 0: the base's outputs) to load
    at run time."""
    import onnxruntime as ort

    root = tmp_path_factory.mktemp("lora-dir")
    for name, directory in lora_build.adapters.items():
        shutil.copytree(directory, root / name)
    session = ort.InferenceSession(str(lora_build.artifact / ADAPTER_GRAPH),
                                   providers=["CPUExecutionProvider"])
    shapes = {i.name: i.shape for i in session.get_inputs()}
    widths = {m: (int(shapes[adapter_spec.lora_a(m)][1]), int(shapes[adapter_spec.lora_b(m)][1]))
              for m in adapter_spec.adapter_modules(list(shapes))}
    write_peft_adapter(root / "zero", widths)
    return root


@pytest.fixture(scope="module")
def lora(lora_build: LoraBuild, lora_root: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """Two adapters over two slots, a third loadable at run time (so one is evicted)."""
    for server in serving(lora_build.artifact,
                          tmp_path_factory.mktemp("lora-server") / "server.log",
                          ("--served-model-name", "tiny", "--device", "cpu", "--max-loras", "2",
                           "--max-lora-rank", "8", "--lora-modules",
                           f"alpha={lora_root / 'alpha'}", f"beta={lora_root / 'beta'}",
                           "--runtime-lora", "--lora-dir", str(lora_root))):
        with httpx.Client(base_url=server.url, timeout=120) as client:
            yield client


def generate(client: httpx.Client, adapter: str, prompt: str, new: int) -> tuple[list[int],
                                                                                  list[int]]:
    """(prompt ids, generated ids) of a greedy TGI request under ``adapter`` ("": base)."""
    parameters: dict[str, Any] = {"max_new_tokens": new, "details": True,
                                  "decoder_input_details": True}
    if adapter:
        parameters["adapter_id"] = adapter
    r = client.post("/generate", json={"inputs": prompt, "parameters": parameters})
    assert r.status_code == 200, r.text
    details = r.json()["details"]
    return ([t["id"] for t in details["prefill"]], [t["id"] for t in details["tokens"]])


PROMPTS = ["ROMEO:", "First Citizen:", "To be, or not", "What say you", "O", "Hark"]


def check_concurrent(client: httpx.Client, build: LoraBuild, asks: list[tuple[str, str]]
                     ) -> None:
    """The requests sent at once (mixed batches), each equal to its merged model alone."""
    with ThreadPoolExecutor(len(asks)) as pool:
        answers = list(pool.map(lambda a: generate(client, a[0], a[1], 8), asks))
    compared = 0
    for (adapter, _), (prompt, got) in zip(asks, answers, strict=True):
        want = merged_greedy(build, adapter, prompt, 8)
        assert got[:len(want)] == want, adapter or "the base"
        compared += len(want)
    assert compared >= 4 * len(asks)  # the margins were clear for most tokens


def test_served_adapters_are_listed_and_answer_as_their_merged_models(
        lora: httpx.Client, lora_build: LoraBuild, lora_root: Path) -> None:
    cards = lora.get("/v1/models").json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [
        ("tiny", None), ("alpha", "tiny"), ("beta", "tiny")]
    assert cards[1]["root"] == str(lora_root / "alpha")
    info = lora.get("/info").json()  # the graph that runs: the adapter graph, every pass
    assert info["decode_graph"] == ADAPTER_GRAPH
    assert [(g["file"], g["runs"], g["row_groups"], g["adapters"]) for g in info["graphs"]] == [
        (ADAPTER_GRAPH, "steps", 2, True)]
    metrics = lora.get("/metrics").text  # and the metrics name the same graph
    assert metric_value(metrics, "attnserve_model_info", {
        "decode_graph": ADAPTER_GRAPH, "kernel": "onnxruntime"}) == 1
    beta_before = metric_value(metrics, "attnserve_lora_requests_total", {"adapter": "beta"})
    asks = [(adapter, prompt) for adapter in ("", "alpha", "beta") for prompt in PROMPTS[:3]]
    check_concurrent(lora, lora_build, asks)
    # the OpenAI model field picks the same adapter as TGI's adapter_id
    r = lora.post("/v1/completions", json={"model": "beta", "prompt": PROMPTS[0],
                                          "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["model"] == "beta"
    tgi = lora.post("/generate", json={"inputs": PROMPTS[0], "parameters": {
        "adapter_id": "beta", "max_new_tokens": 8}}).json()["generated_text"]
    assert r.json()["choices"][0]["text"] == tgi
    metrics = lora.get("/metrics").text
    assert metric_value(metrics, "attnserve_lora_requests_total",
                        {"adapter": "beta"}) == beta_before + 5  # 3 + 2 requests here
    assert metric_value(metrics, "attnserve_lora_loads_total", {"adapter": "alpha"}) >= 1


def test_adapters_loaded_evicted_and_unloaded_at_run_time_answer_rightly(
        lora: httpx.Client, lora_build: LoraBuild) -> None:
    r = lora.post("/v1/load_lora_adapter", json={"lora_name": "zero", "lora_path": "zero"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'zero' added successfully."
    # three adapters over two slots, at once: one waits for a slot, one is evicted
    asks = [(adapter, prompt) for adapter in ("zero", "alpha", "beta", "")
            for prompt in PROMPTS[3:]]
    with ThreadPoolExecutor(len(asks)) as pool:
        answers = list(pool.map(lambda a: generate(lora, a[0], a[1], 8), asks))
    for (adapter, _), (prompt, got) in zip(asks, answers, strict=True):
        want = merged_greedy(lora_build, adapter if adapter != "zero" else "", prompt, 8)
        assert got[:len(want)] == want, adapter or "the base"
    metrics = lora.get("/metrics").text
    assert sum(metric_value(metrics, "attnserve_lora_evictions_total", {"adapter": a})
               for a in ("zero", "alpha", "beta")) >= 1
    # an unload waits for the adapter's request in flight, which ends whole
    with lora.stream("POST", "/generate_stream", json={"inputs": PROMPTS[0], "parameters": {
            "adapter_id": "zero", "max_new_tokens": 24}}) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert '"token"' in first  # the request is in flight
        with ThreadPoolExecutor(1) as pool:
            unload = pool.submit(lora.post, "/v1/unload_lora_adapter",
                                 json={"lora_name": "zero"})
            rest = [line for line in lines if line.startswith("data:")]
            assert '"generated_text"' in rest[-1] and '"length"' in rest[-1]
            assert unload.result().status_code == 200
    assert lora.post("/v1/completions", json={"model": "zero", "prompt": "a"}
                     ).status_code == 404
    assert [c["id"] for c in lora.get("/v1/models").json()["data"]] == ["tiny", "alpha", "beta"]


# ---------------------------------------------------- /attention: adapter and control vector


def test_head_attribution_under_an_adapter_is_501_naming_adapter_id(
        lora: httpx.Client) -> None:
    """Each head's output through o_proj misses o_proj's LoRA update, so attribution under an
    adapter is refused (501, the field named); the lens under it, and attribution without
    it, are answered."""
    body: dict[str, Any] = {"inputs": PROMPTS[0], "include": ["head_attribution"],
                            "adapter_id": "alpha"}
    r = lora.post("/attention", json=body)
    assert r.status_code == 501, r.text
    assert r.json()["error"].startswith("adapter_id: head_attribution under an adapter")
    assert lora.post("/attention", json={**body, "include": ["logit_lens"]}).status_code == 200
    del body["adapter_id"]
    r = lora.post("/attention", json=body)
    assert r.status_code == 200, r.text
    assert "head_attribution" in r.json()


def _vector(lora_build: LoraBuild, root: Path) -> tuple[Path, np.ndarray]:
    """A random control vector for the tiny Llama (layer 1, its only steerable one) and the
    (n_layers, d) rows it adds at scale 2."""
    config = io.ArtifactConfig.load(lora_build.artifact)
    rng = np.random.default_rng(4)
    direction = (rng.standard_normal(config.d_model) / np.sqrt(config.d_model)).astype(np.float32)
    rows = np.zeros((config.n_layers, config.d_model), np.float32)
    rows[1] = direction * np.float32(2.0)
    return write_control_vector(ControlVector({1: direction}), root / "v.gguf"), rows


def test_attention_under_an_adapter_and_a_vector_is_the_merged_model_steered(
        lora_build: LoraBuild, lora_root: Path, tmp_path: Path) -> None:
    """Both at once: attention_lora.onnx with the adapter's weights and the vector's rows,
    against the merged model's attention.onnx under the same rows; an artifact whose
    attention_lora.onnx predates steer answers 409 for the pair (each alone still works)."""
    import onnxruntime as ort

    vector, rows = _vector(lora_build, tmp_path)
    args = ("--device", "cpu", "--lora-modules", f"alpha={lora_root / 'alpha'}",
            "--control-vectors", f"v={vector}")
    body = {"inputs": PROMPTS[1], "include": ["weights", "residual_norms"],
            "adapter_id": "alpha", "control_vector": {"name": "v", "scale": 2.0}}
    with contextmanager(serving)(lora_build.artifact, tmp_path / "server.log", args) as proc:
        r = httpx.post(f"{proc.url}/attention", json=body, timeout=60)
        assert r.status_code == 200, r.text
        got = r.json()
        adapted = httpx.post(f"{proc.url}/attention", timeout=60, json={
            k: v for k, v in body.items() if k != "control_vector"}).json()
    ids = np.asarray([[t["id"] for t in got["tokens"]]], np.int64)
    config = io.ArtifactConfig.load(lora_build.artifact)
    merged = ort.InferenceSession(str(lora_build.merged["alpha"] / io.ATTENTION_FILE),
                                  providers=["CPUExecutionProvider"])
    names = [*(io.attention_output_name(i, "weights") for i in range(config.n_layers)),
             *(f"residual_norm.{i}" for i in range(config.n_layers))]
    want = merged.run(names, {io.INPUT_IDS: ids, io.ATTENTION_MASK: np.ones_like(ids),
                              io.POSITION_IDS: np.arange(ids.shape[1])[None, :],
                              io.STEER: rows})
    n = config.n_layers
    np.testing.assert_allclose(got["attention"]["weights"], np.concatenate(want[:n]),
                               atol=1e-5)
    np.testing.assert_allclose(got["residual_norms"], np.concatenate(want[n:]), rtol=1e-5)
    # the vector reached the stream after block 1
    assert np.abs(np.asarray(got["residual_norms"]) - adapted["residual_norms"]).max() > 1e-3

    old = without_steer(lora_build.artifact, tmp_path / "old",
                        adapter_spec.lora_file(io.ATTENTION_FILE))
    with contextmanager(serving)(old, tmp_path / "old.log", args) as proc:
        r = httpx.post(f"{proc.url}/attention", json=body, timeout=60)
        assert r.status_code == 409, r.text
        error = r.json()["error"]
        assert error.startswith("control_vector: ") and "attention_lora.onnx" in error
        assert "adapter_id" in error
        for alone in ("adapter_id", "control_vector"):
            one = {k: v for k, v in body.items() if k != alone}
            assert httpx.post(f"{proc.url}/attention", json=one, timeout=60).status_code == 200
