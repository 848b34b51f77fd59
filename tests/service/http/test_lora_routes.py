"""LoRA adapters at the HTTP layer, without the adapter graph: the app in process over the
tiny artifact, its engine replaced by one holding a real ``AdapterSet`` (adapters read,
checked, counted and unloaded as the server does) whose ``submit`` records the requests.

What is checked: the OpenAI ``model`` and TGI ``adapter_id`` fields reach
``GenerationRequest.adapter_name``; unknown names are 404 in each API's shape (also when
the engine refuses one unloaded meanwhile); /v1/models' adapter cards; vLLM's run-time
load/unload routes and every refusal; the ``attnserve_lora_*`` metrics and their bounded
label; settings and CLI parsing of --lora-modules. Servers that run adapters:
test_lora_serving.py.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.artifact.loader import open_artifact
from service.contract import io_spec as io
from service.engine.adapters import AdapterLimits, AdapterSet, AdapterSlots, UnknownAdapter
from service.engine.request import GenerationRequest
from service.engine.scheduler import QueueFull
from service.engine.stats import RequestStats
from service.http.app import create_app
from service.http.metrics import OTHER_ADAPTERS, Metrics
from service.http.runtime import Runtime, configured_adapters
from service.http.validation import Validator
from service.providers import create_session
from service.settings import Settings
from service.viz.attention_model import AttentionModel
from tests.service.helpers import metric_value, write_peft_adapter

BASE = "tiny"
WIDTHS = {"model.layers.0.self_attn.q_proj": (8, 8), "model.layers.0.mlp.down_proj": (16, 8)}
KEY = "lora-key"


class RecordingEngine:
    """What the routes reach of an engine: its adapters, and a submit that records the
    requests and refuses them (``error``), so no generation runs."""

    def __init__(self, adapters: AdapterSet) -> None:
        self.adapters = adapters
        self.submitted: list[GenerationRequest] = []
        self.error: Exception = QueueFull("held by the test")

    def submit(self, requests: Sequence[GenerationRequest]) -> list[Any]:
        self.submitted.extend(requests)
        raise self.error


class App:
    def __init__(self, artifact: Path, lora_dir: Path, **options: Any) -> None:
        settings = Settings(model=artifact, served_model_name=BASE, lora_dir=lora_dir,
                            **options)
        opened = open_artifact(settings)
        metrics = Metrics()
        config = opened.config
        self.runtime = Runtime(settings, opened, metrics, Validator(
            opened.codec, opened.limits, config.eos_token_id, opened.default_max_new_tokens,
            vocab_size=config.vocab_size))
        self.adapters = AdapterSet(AdapterSlots(WIDTHS, AdapterLimits(max_loras=2,
                                                                      max_lora_rank=4)))
        for name, directory in self.runtime.adapter_roots.items():
            self.adapters.add(self.adapters.read(Path(directory), name))
        self.engine = RecordingEngine(self.adapters)
        self.runtime.engine = self.engine  # type: ignore[assignment]
        self.runtime.ready = True
        metrics.watch_adapters(self.adapters)
        app = create_app(settings, opened)
        app.state.runtime = self.runtime  # no lifespan: nothing loads
        headers = {"Authorization": f"Bearer {KEY}"} if settings.api_key else {}
        self.client = TestClient(app, headers=headers)

    def metric(self, name: str, **labels: str) -> float:
        return metric_value(self.client.get("/metrics").text, name, labels)


@pytest.fixture(autouse=True)
def _no_attnserve_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("ATTNSERVE_")]:
        monkeypatch.delenv(key)


@pytest.fixture
def lora_dir(tmp_path: Path) -> Path:
    root = tmp_path / "adapters"
    write_peft_adapter(root / "sql", WIDTHS)
    write_peft_adapter(root / "chat", WIDTHS, b_value=0.5)
    return root


@pytest.fixture
def app(artifact: Path, lora_dir: Path) -> Iterator[App]:
    yield App(artifact, lora_dir, runtime_lora=True,
              lora_modules=(f"sql={lora_dir / 'sql'}",))


def load(app: App, name: str, path: str) -> Any:
    return app.client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


# -- selection -------------------------------------------------------------------------------


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": "sql", "prompt": "ab", "max_tokens": 2}),
    ("/v1/completions", {"model": "sql", "prompt": "ab", "max_tokens": 2, "stream": True}),
    ("/v1/chat/completions", {"model": "sql", "max_tokens": 2,
                              "messages": [{"role": "user", "content": "ab"}]}),
    ("/v1/chat/completions", {"model": "sql", "max_tokens": 2, "stream": True,
                              "messages": [{"role": "user", "content": "ab"}]}),
    ("/generate", {"inputs": "ab", "parameters": {"adapter_id": "sql"}}),
    ("/generate", {"inputs": ["ab", "cd"], "parameters": {"adapter_id": "sql"}}),
    ("/generate_stream", {"inputs": "ab", "parameters": {"adapter_id": "sql"}}),
    ("/", {"inputs": "ab", "parameters": {"adapter_id": "sql"}, "stream": True}),
])
def test_model_and_adapter_id_choose_the_adapter(app: App, path: str,
                                                 body: dict[str, Any]) -> None:
    r = app.client.post(path, json=body)
    assert r.status_code == 429, r.text  # the recording engine refuses after recording
    assert app.engine.submitted and {q.adapter_name for q in app.engine.submitted} == {"sql"}


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": BASE, "prompt": "ab", "max_tokens": 2}),
    ("/generate", {"inputs": "ab"}),
])
def test_the_base_name_or_no_adapter_id_is_the_base(app: App, path: str,
                                                    body: dict[str, Any]) -> None:
    assert app.client.post(path, json=body).status_code == 429
    assert [q.adapter_name for q in app.engine.submitted] == [None]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": "nope", "prompt": "ab"}),
    ("/v1/completions", {"model": "nope", "prompt": "ab", "stream": True}),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "a"}]}),
    ("/tokenize", {"model": "nope", "prompt": "ab"}),
    ("/detokenize", {"model": "nope", "tokens": [1]}),
])
def test_an_unknown_model_is_vllms_404(app: App, path: str, body: dict[str, Any]) -> None:
    r = app.client.post(path, json=body)
    assert r.status_code == 404, r.text
    if path.startswith("/v1"):
        assert r.json() == {"error": {"message": "The model `nope` does not exist.",
                                      "type": "NotFoundError", "param": "model",
                                      "code": "model_not_found"}}
    else:
        assert r.json()["error_type"] == "not_found"
    assert not app.engine.submitted


@pytest.mark.parametrize("path,body", [
    ("/generate", {"inputs": "ab", "parameters": {"adapter_id": "nope"}}),
    ("/generate_stream", {"inputs": "ab", "parameters": {"adapter_id": "nope"}}),
    ("/", {"inputs": "ab", "parameters": {"adapter_id": "nope"}}),
    ("/tokenize", {"inputs": "ab", "parameters": {"adapter_id": "nope"}}),
    ("/attention", {"inputs": "ab", "adapter_id": "nope"}),
])
def test_an_unknown_adapter_id_is_a_tgi_404(app: App, path: str, body: dict[str, Any]) -> None:
    r = app.client.post(path, json=body)
    assert r.status_code == 404, r.text
    assert r.json()["error_type"] == "not_found" and "'nope'" in r.json()["error"]
    assert not app.engine.submitted


def test_an_adapter_unloaded_before_submit_is_the_same_404(app: App) -> None:
    app.engine.error = UnknownAdapter("sql")
    r = app.client.post("/v1/completions", json={"model": "sql", "prompt": "ab"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    r = app.client.post("/generate", json={"inputs": "ab", "parameters": {"adapter_id": "sql"}})
    assert r.status_code == 404 and r.json()["error_type"] == "not_found"


def test_tokenize_takes_an_adapter_and_answers_as_the_base(app: App) -> None:
    base = app.client.post("/tokenize", json={"prompt": "abc"}).json()
    assert app.client.post("/tokenize", json={"model": "sql", "prompt": "abc"}).json() == base
    tgi = app.client.post("/tokenize", json={"inputs": "abc",
                                             "parameters": {"adapter_id": "sql"}})
    assert tgi.status_code == 200 and [t["id"] for t in tgi.json()] == base["tokens"]


def test_attention_under_an_adapter_is_501_for_an_artifact_without_its_adapter_graph(
        app: App, tmp_path: Path) -> None:
    artifact = app.runtime.artifact.path
    for name in (io.ATTENTION_FILE, "weights.bin"):  # an export from before adapter graphs
        shutil.copy(artifact / name, tmp_path / name)
    source = tmp_path / io.ATTENTION_FILE
    app.runtime.attention = AttentionModel(
        create_session(source, "cpu", 1, prepack=False), app.runtime.artifact.config, source,
        app.adapters)
    r = app.client.post("/attention", json={"inputs": "ab", "adapter_id": "sql"})
    assert r.status_code == 501, r.text
    assert r.json()["error_type"] == "not_implemented"
    assert "attention_lora.onnx" in r.json()["error"] and "\n" not in r.json()["error"]
    assert app.client.post("/attention", json={"inputs": "ab"}).status_code == 200


# -- /v1/models ------------------------------------------------------------------------------


def test_models_list_the_base_then_each_adapter(app: App, lora_dir: Path) -> None:
    cards = app.client.get("/v1/models").json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [(BASE, None), ("sql", BASE)]
    assert cards[1]["root"] == str(lora_dir / "sql")
    assert app.client.get("/v1/models/sql").json() == cards[1]
    missing = app.client.get("/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
    schema = app.client.get("/openapi.json").json()["components"]["schemas"]
    assert schema["CompletionRequest"]["properties"]["model"]["enum"] == [BASE, "sql"]


# -- run-time load and unload ----------------------------------------------------------------


def test_load_serves_the_adapter_and_unload_removes_it(app: App, lora_dir: Path) -> None:
    r = load(app, "chat", "chat")  # relative: under lora_dir
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'chat' added successfully."
    assert r.headers["content-type"].startswith("text/plain")
    assert sorted(app.adapters.names()) == ["chat", "sql"]
    cards = app.client.get("/v1/models").json()["data"]
    assert cards[-1] == {**cards[-1], "id": "chat", "parent": BASE,
                         "root": str((lora_dir / "chat").resolve())}
    schema = app.client.get("/openapi.json").json()["components"]["schemas"]
    assert "chat" in schema["CompletionRequest"]["properties"]["model"]["enum"]
    assert app.client.post("/v1/completions", json={"model": "chat", "prompt": "ab"}
                           ).status_code == 429
    r = app.client.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert r.status_code == 200
    assert r.text == "Success: LoRA adapter 'chat' removed successfully."
    assert app.adapters.names() == ["sql"]
    assert [c["id"] for c in app.client.get("/v1/models").json()["data"]] == [BASE, "sql"]
    assert app.client.post("/v1/completions", json={"model": "chat", "prompt": "ab"}
                           ).status_code == 404


def test_every_refused_load_is_a_400_naming_why_and_loads_nothing(
        app: App, lora_dir: Path, tmp_path: Path) -> None:
    outside = write_peft_adapter(tmp_path / "outside", WIDTHS)
    (lora_dir / "link").symlink_to(outside)
    (lora_dir / "empty").mkdir()
    write_peft_adapter(lora_dir / "other-model", {"model.layers.0.self_attn.q_proj": (4, 4)})
    write_peft_adapter(lora_dir / "too-wide", WIDTHS, rank=8)
    write_peft_adapter(lora_dir / "dora", WIDTHS, use_dora=True)
    cases = [("x", str(outside), "leads outside"), ("x", "../outside", "leads outside"),
             ("x", "link", "leads outside"), ("x", "missing", "does not exist"),
             ("x", "empty", "not a PEFT adapter"), ("x", "other-model", "maps 4 → 4"),
             ("x", "too-wide", "above --max-lora-rank"), ("x", "dora", "DoRA")]
    for name, path, why in cases:
        r = load(app, name, path)
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert error["code"] == "invalid_adapter" and why in error["message"], (path, error)
    for name, code in (("sql", "adapter_exists"), (BASE, "adapter_exists")):
        r = load(app, name, "chat")
        assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
    assert app.adapters.names() == ["sql"]


def test_unload_of_an_unknown_adapter_is_404_and_one_in_use_409_after_the_drain_timeout(
        artifact: Path, lora_dir: Path) -> None:
    app = App(artifact, lora_dir, runtime_lora=True, drain_timeout=0.2,
              lora_modules=(f"sql={lora_dir / 'sql'}",))
    r = app.client.post("/v1/unload_lora_adapter", json={"lora_name": "nope"})
    assert r.status_code == 404 and r.json()["error"]["message"] == (
        "The lora adapter 'nope' cannot be found.")
    app.adapters.begin("sql")  # a request in flight that never ends
    r = app.client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "adapter_busy", r.text
    # it already takes no new requests
    assert app.client.post("/v1/completions", json={"model": "sql", "prompt": "ab"}
                           ).status_code == 404


def test_without_runtime_lora_the_routes_do_not_exist(artifact: Path, lora_dir: Path) -> None:
    app = App(artifact, lora_dir)
    assert load(app, "chat", "chat").status_code == 404
    assert app.client.post("/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code == 404
    paths = app.client.get("/openapi.json").json()["paths"]
    assert "/v1/load_lora_adapter" not in paths


def test_the_routes_need_the_api_key(artifact: Path, lora_dir: Path) -> None:
    app = App(artifact, lora_dir, runtime_lora=True, api_key=KEY)
    assert load(app, "chat", "chat").status_code == 200
    bare = TestClient(app.client.app)
    r = bare.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "chat"})
    assert r.status_code == 401
    assert bare.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 401
    paths = app.client.get("/openapi.json").json()["paths"]
    assert paths["/v1/load_lora_adapter"]["post"]["security"] == [{"bearer": []}]
    assert {"200", "400", "401"} <= set(paths["/v1/load_lora_adapter"]["post"]["responses"])
    assert {"404", "409"} <= set(paths["/v1/unload_lora_adapter"]["post"]["responses"])


# -- metrics ---------------------------------------------------------------------------------


def test_lora_metrics_count_requests_tokens_loads_and_residency(app: App) -> None:
    metrics = app.runtime.metrics
    for adapter, tokens in (("sql", 5), ("sql", 3), (None, 7)):
        metrics.record_request(RequestStats("finished", 4, tokens, 0.0, 0.0, (),
                                            adapter=adapter))
    assert app.metric("attnserve_lora_requests_total", adapter="sql") == 2
    assert app.metric("attnserve_lora_generated_tokens_total", adapter="sql") == 8
    assert app.metric("attnserve_lora_requests_total", adapter="") == 0
    ref = app.adapters.begin("sql")
    assert app.adapters.acquire(ref)
    assert app.metric("attnserve_lora_loads_total", adapter="sql") == 1
    assert app.metric("attnserve_lora_resident") == 1
    assert app.metric("attnserve_lora_resident_bytes") > 0
    app.adapters.release(ref)
    app.adapters.end(ref)
    assert app.client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}
                           ).status_code == 200
    assert app.metric("attnserve_lora_loads_total", adapter="sql") == 1  # kept after unload
    assert app.metric("attnserve_lora_resident") == 0


def test_the_adapter_label_is_bounded() -> None:
    metrics = Metrics()
    metrics.adapter_labels.runtime_bound = 2
    metrics.allow_adapter("configured", configured=True)
    for name in ("a", "b", "c", "d"):
        metrics.allow_adapter(name)
    for name in ("configured", "a", "b", "c", "d", "never-served"):
        metrics.record_request(RequestStats("finished", 1, 1, 0.0, 0.0, (), adapter=name))
    text = metrics.render()[0].decode()
    labels = {s: metric_value(text, "attnserve_lora_requests_total", {"adapter": s})
              for s in ("configured", "a", "b", "c", OTHER_ADAPTERS)}
    assert labels == {"configured": 1, "a": 1, "b": 1, "c": 0, OTHER_ADAPTERS: 3}


def test_loads_of_an_adapter_loaded_again_under_its_name_keep_adding_up() -> None:
    metrics = Metrics()
    metrics.allow_adapter("a")
    counts = {"a": {"loads": 3, "evictions": 1}}
    metrics.adapter_counts.source = lambda: counts
    text = metrics.render()[0].decode()
    assert metric_value(text, "attnserve_lora_loads_total", {"adapter": "a"}) == 3
    counts = {"a": {"loads": 1, "evictions": 0}}  # unloaded, loaded again
    text = metrics.render()[0].decode()
    assert metric_value(text, "attnserve_lora_loads_total", {"adapter": "a"}) == 4
    assert metric_value(text, "attnserve_lora_evictions_total", {"adapter": "a"}) == 1


# -- settings --------------------------------------------------------------------------------


def test_lora_modules_from_flags_and_from_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from service.serve_cli import register, settings_from

    root = argparse.ArgumentParser(prog="attnserve")
    register(root.add_subparsers())
    args = root.parse_args(["serve", "--model", "m", "--lora-modules", "a=/x", "b=/y",
                            "--runtime-lora", "--lora-dir", "/adapters", "--max-loras", "2"])
    settings = settings_from(args)
    assert settings.lora_modules == ("a=/x", "b=/y") and settings.serves_adapters
    assert (settings.runtime_lora, settings.lora_dir, settings.max_loras) == (
        True, Path("/adapters"), 2)
    monkeypatch.setenv("ATTNSERVE_LORA_MODULES", "a=/x,b=/y")
    from_env = settings_from(root.parse_args(["serve", "--model", "m"]))
    assert from_env.lora_modules == ("a=/x", "b=/y")
    monkeypatch.setenv("ATTNSERVE_LORA_MODULES", " a=/x  b=/y ")
    assert Settings(model=Path("m")).lora_modules == ("a=/x", "b=/y")
    assert configured_adapters(from_env.lora_modules) == {"a": "/x", "b": "/y"}
    monkeypatch.delenv("ATTNSERVE_LORA_MODULES")
    assert not Settings(model=Path("m")).serves_adapters
