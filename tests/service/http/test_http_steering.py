"""Control vectors through HTTP (`attnserve serve --control-vectors NAME=FILE`): a request
steered by TGI's ``parameters.control_vector`` or OpenAI's extra body field gets the
greedy tokens of the PyTorch model under model/steering.py's ``steered()``, and, where
llama.cpp's tools are built, those of ``llama-server --control-vector-scaled FILE:SCALE``
on the same model's GGUF file with the same vector file (skipped otherwise, with the
build command). Refusals: an unknown name (404), a scale beyond --max-control-scale (422
naming the field), a file that does not fit the model (one line at start). /info lists the
vectors, /metrics counts them.

The model: a random 3-layer Llama made by transformers, imported, exported with its
engine graphs and as GGUF; the vector: `attnserve steer`'s mean vector of three prompt
pairs (tests/export/test_steer.py checks it against llama-cvector-generator).

/attention under the same vector: its maps, logit lens and attribution are the PyTorch
model's under ``steered()`` (forward hooks), scale 0 is no vector, and it refuses as
/generate does (404, 422), or with 409 where attention.onnx takes no ``steer``.
"""

from __future__ import annotations

import io as io_
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from model.checkpoint import load_checkpoint
from model.steering import block_outputs, steered
from service.contract import io_spec as io
from service.contract.control_vector import ControlVector, write_control_vector
from tests.conftest import torch_threads
from tests.export.test_steer import FLOAT32, PAIRS, ours_greedy, write_pairs
from tests.service.helpers import (
    ServerProcess,
    metric_value,
    serving,
    wait_metric,
    without_steer,
)

LAYERS = 3
SCALE = 4.0
TEXTS = ["hello world", "the cat sat on"]


@dataclass
class Steered:
    checkpoint: Path
    artifact: Path
    gguf: Path
    vector: Path


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Steered:
    pytest.importorskip("transformers")
    from export.gguf.model_file import export_gguf
    from export.steer import steer
    from export.to_onnx import export_artifact
    from model.hf_import import import_hf_checkpoint
    from tests.hf_llama import build_hf_model

    root = tmp_path_factory.mktemp("steer-http")
    with torch_threads(1):
        build_hf_model(root / "hf", "llama", seed=1, num_hidden_layers=LAYERS)
        ckpt = import_hf_checkpoint(root / "hf", root / "ckpt")
        artifact = export_artifact(ckpt, root / "artifact", engine_graph=True, verify=False)
        vector = steer(ckpt, write_pairs(root / "pairs.jsonl", PAIRS), root / "v.gguf", "mean")
        return Steered(ckpt, artifact, export_gguf(ckpt, root / "model.gguf"), vector)


@pytest.fixture(scope="module")
def server(build: Steered, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    yield from serving(build.artifact, tmp_path_factory.mktemp("log") / "server.log",
                       ("--control-vectors", f"v={build.vector}", "--no-prefix-caching"))


def ids_of(server: ServerProcess, text: str) -> list[int]:
    tokens = httpx.post(f"{server.url}/tokenize", json={"inputs": text}, timeout=30).json()
    return [t["id"] for t in tokens]


def tgi_generate(server: ServerProcess, text: str, control: dict[str, Any] | None,
                 n: int = 16) -> dict[str, Any]:
    parameters: dict[str, Any] = {"max_new_tokens": n, "details": True}
    if control is not None:
        parameters["control_vector"] = control
    answer = httpx.post(f"{server.url}/generate", json={"inputs": text,
                                                        "parameters": parameters}, timeout=60)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def tgi_tokens(server: ServerProcess, text: str, control: dict[str, Any] | None,
               n: int = 16) -> list[int]:
    return [t["id"] for t in tgi_generate(server, text, control, n)["details"]["tokens"]]


def reference(build: Steered, ids: list[int], scale: float | None, n: int = 16) -> list[int]:
    """PyTorch's greedy tokens, steered by the vector file at ``scale`` (None: not at all)."""
    from service.contract.control_vector import read_control_vector

    model = load_checkpoint(build.checkpoint).model.eval()
    if scale is None:
        return ours_greedy(model, ids, n)
    with steered(model, read_control_vector(build.vector).directions, scale):
        return ours_greedy(model, ids, n)


def test_tgi_and_openai_requests_are_steered_as_the_torch_reference(
        build: Steered, server: ServerProcess) -> None:
    for text in TEXTS:
        ids = ids_of(server, text)
        want = reference(build, ids, SCALE)
        assert want != reference(build, ids, None)  # the vector matters at this scale
        got = tgi_tokens(server, text, {"name": "v", "scale": SCALE})
        assert got == want[:len(got)] and len(got) >= min(len(want), 4), text
        assert tgi_tokens(server, text, None) == reference(build, ids, None)[:len(got)]
        answer = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"],
            "prompt": ids, "max_tokens": 16, "temperature": 0,
            "control_vector": {"name": "v", "scale": SCALE}})
        assert answer.status_code == 200, answer.text
        tgi = tgi_generate(server, text, {"name": "v", "scale": SCALE})
        assert answer.json()["choices"][0]["text"] == tgi["generated_text"], text


def test_the_same_vector_file_gives_llama_server_s_greedy_tokens(
        build: Steered, server: ServerProcess, tmp_path: Path) -> None:
    from tests.llamacpp_server import llama_server

    args = [*FLOAT32, "--control-vector-scaled", f"{build.vector}:{SCALE}"]
    with llama_server(build.gguf, log=tmp_path / "llama-server.log", args=args) as theirs:
        for text in TEXTS:
            ids = ids_of(server, text)
            ours = tgi_tokens(server, text, {"name": "v", "scale": SCALE})
            assert len(ours) >= 4 and theirs.greedy(ids, 16)[:len(ours)] == ours, text


def test_unknown_names_and_scales_beyond_the_maximum_are_refused(server: ServerProcess
                                                                 ) -> None:
    unknown = httpx.post(f"{server.url}/generate", timeout=30, json={
        "inputs": "hello", "parameters": {"control_vector": {"name": "nope", "scale": 1}}})
    assert unknown.status_code == 404
    assert unknown.json()["error_type"] == "not_found" and "'nope'" in unknown.json()["error"]
    too_far = httpx.post(f"{server.url}/generate", timeout=30, json={
        "inputs": "hello", "parameters": {"control_vector": {"name": "v", "scale": -4.5}}})
    assert too_far.status_code == 422
    assert "parameters.control_vector.scale" in too_far.json()["error"]
    model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    openai = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
        "model": model, "prompt": "hello", "control_vector": {"name": "nope", "scale": 1}})
    assert openai.status_code == 404
    assert openai.json()["error"]["param"] == "control_vector.name"


def test_info_lists_the_vectors_and_metrics_count_them(server: ServerProcess) -> None:
    info = httpx.get(f"{server.url}/info", timeout=30).json()
    assert info["control_vectors"] == ["v"] and info["max_control_scale"] == 4.0
    def read(name: str) -> float:
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        return metric_value(text, name, {"vector": "v"})

    requests = "attnserve_control_vector_requests_total"
    generated = "attnserve_control_vector_generated_tokens_total"
    before = read(requests), read(generated)
    tokens = tgi_tokens(server, "hello", {"name": "v", "scale": 1.0}, n=5)
    wait_metric(server, requests, before[0] + 1)  # recorded as the request leaves
    assert read(generated) == before[1] + len(tokens)


def test_a_file_that_does_not_fit_the_model_stops_the_start_in_one_line(
        build: Steered, tmp_path: Path) -> None:
    wide = write_control_vector(ControlVector(
        {1: np.ones(32, np.float32), 2: np.ones(32, np.float32)}), tmp_path / "wide.gguf")
    result = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--model",
                             str(build.artifact), "--port", "0", "--control-vectors",
                             f"w={wide}"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "width 32" in result.stderr and "d_model is 64" in result.stderr
    assert result.stderr.count("\n") == 1  # one line, no traceback


# ---------------------------------------------------------------------------- /attention


def attention(server: ServerProcess, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/attention", json=body, timeout=60)


def steered_torch(build: Steered, ids: list[int], scale: float
                  ) -> tuple[np.ndarray, list[Any], Any]:
    """The PyTorch model under steered(): every layer's attention weights (L, nh, T, T),
    each layer's logit lens (its block's output through the final norm and the LM head,
    as probabilities (T, V)) and the logits (T, V)."""
    import torch

    from service.contract.control_vector import read_control_vector

    model = load_checkpoint(build.checkpoint).model.eval()
    with steered(model, read_control_vector(build.vector).directions, scale), torch.no_grad():
        out = model(torch.tensor([ids]), return_intermediates=True)
        lens = [torch.softmax(model.head(r)[0].double(), -1)
                for r in block_outputs(model, torch.tensor([ids]))]
    weights = np.stack([i.weights[0].numpy() for i in out.intermediates])
    return weights, lens, out.logits[0]


def test_attention_under_a_vector_is_the_steered_torch_model(build: Steered,
                                                             server: ServerProcess) -> None:
    text = TEXTS[1]
    ids = ids_of(server, text)
    control = {"name": "v", "scale": SCALE}
    r = attention(server, {"inputs": text, "control_vector": control,
                           "include": ["weights", "logit_lens", "head_attribution"]})
    assert r.status_code == 200, r.text
    body = r.json()
    want, lens_probs, logits = steered_torch(build, ids, SCALE)
    np.testing.assert_allclose(np.asarray(body["attention"]["weights"]), want, atol=1e-5)
    unsteered = attention(server, {"inputs": text}).json()["attention"]["weights"]
    assert np.abs(np.asarray(unsteered)[2] - want[2]).max() > 1e-3  # the vector matters
    lens = body["logit_lens"]
    for layer, probs in enumerate(lens_probs):  # (T, V) each
        top_p, top_ids = probs.topk(2, -1)
        apart = (top_p[:, 0] - top_p[:, 1] > 1e-5).numpy()
        got_top1 = np.asarray(lens["top_ids"][layer])[:, 0]
        np.testing.assert_array_equal(got_top1[apart], top_ids[:, 0].numpy()[apart])
        np.testing.assert_allclose(np.asarray(lens["top_probs"][layer])[:, 0],
                                   top_p[:, 0].numpy(), atol=1e-5)
    attr = body["head_attribution"]
    target = int(logits[-1].argmax())
    assert attr["target"] == target
    assert attr["logit"] == pytest.approx(float(logits[-1, target]), abs=1e-4)
    assert attr["control_vector"][0] == 0.0 and max(map(abs, attr["control_vector"])) > 1e-3
    total = (attr["embedding"] + np.sum(attr["heads"]) + sum(attr["attention_bias"])
             + sum(attr["mlp"]) + sum(attr["mlp_bias"]) + sum(attr["control_vector"])
             + attr["norm_bias"])
    assert total == pytest.approx(float(logits[-1, target]), abs=1e-3)


def test_attention_under_a_vector_at_scale_zero_is_the_unsteered(server: ServerProcess
                                                                 ) -> None:
    members = {"inputs": TEXTS[0], "include": ["weights", "logit_lens", "residual_norms"]}
    plain = attention(server, members).json()
    zero = attention(server, members | {"control_vector": {"name": "v", "scale": 0}}).json()
    assert zero.pop("control_vector") == {"name": "v", "scale": 0, "layers": [1, LAYERS - 1]}
    assert zero == plain


def test_attention_names_the_vector_it_was_computed_under(server: ServerProcess) -> None:
    """JSON (and bertviz) ``control_vector`` and npz ``control_vector.*`` echo the request's
    vector with its layers resolved (absent: 1 … n_layers − 1, which computes what naming
    that range computes); without a vector there is no such member."""
    members = {"inputs": TEXTS[1], "include": ["weights", "logit_lens"]}
    given = attention(server, members | {"control_vector": {
        "name": "v", "scale": 1.5, "layers": [2, 2]}}).json()
    assert given["control_vector"] == {"name": "v", "scale": 1.5, "layers": [2, 2]}
    resolved = attention(server, members | {"control_vector": {"name": "v"}}).json()
    assert resolved["control_vector"] == {"name": "v", "scale": 1.0, "layers": [1, LAYERS - 1]}
    explicit = attention(server, members | {"control_vector": {
        "name": "v", "layers": [1, LAYERS - 1]}}).json()
    assert explicit == resolved
    assert "control_vector" not in attention(server, members).json()
    bertviz = attention(server, {"inputs": TEXTS[1], "format": "bertviz",
                                 "control_vector": {"name": "v", "scale": -2}}).json()
    assert bertviz["control_vector"] == {"name": "v", "scale": -2, "layers": [1, LAYERS - 1]}
    npz = attention(server, members | {"format": "npz", "control_vector": {
        "name": "v", "scale": 1.5, "layers": [2, 2]}})
    with np.load(io_.BytesIO(npz.content)) as archive:
        assert str(archive["control_vector.name"]) == "v"
        assert float(archive["control_vector.scale"]) == 1.5
        assert archive["control_vector.layers"].tolist() == [2, 2]
    plain = attention(server, members | {"format": "npz"})
    with np.load(io_.BytesIO(plain.content)) as archive:
        assert not [k for k in archive.files if k.startswith("control_vector")]
    declared = httpx.get(f"{server.url}/openapi.json").json()["paths"]["/attention"]["post"][
        "responses"]["200"]["content"]["application/json"]["schema"]["properties"]
    assert declared["control_vector"]["required"] == ["name", "scale", "layers"]


def test_attention_refuses_a_vector_as_generate_does(server: ServerProcess) -> None:
    unknown = attention(server, {"inputs": "hello", "control_vector": {"name": "nope"}})
    assert unknown.status_code == 404
    assert unknown.json()["error_type"] == "not_found"
    assert unknown.json()["error"] == \
        "control_vector.name: control vector 'nope' is not served by this server"
    for control in ({"name": "v", "scale": -4.5}, {"name": "v", "layers": [2, 1]}):
        generated = httpx.post(f"{server.url}/generate", timeout=30, json={
            "inputs": "hello", "parameters": {"control_vector": control}})
        attended = attention(server, {"inputs": "hello", "control_vector": control})
        assert (generated.status_code, attended.status_code) == (422, 422), attended.text
        assert attended.json()["error"] == generated.json()["error"].replace(
            "parameters.control_vector", "control_vector")


def test_an_attention_graph_without_steer_answers_409_naming_the_field(
        build: Steered, tmp_path: Path) -> None:
    old = without_steer(build.artifact, tmp_path / "old", io.ATTENTION_FILE)
    with contextmanager(serving)(old, tmp_path / "server.log",
                                 ("--control-vectors", f"v={build.vector}")) as proc:
        r = attention(proc, {"inputs": "hello", "control_vector": {"name": "v"}})
        assert r.status_code == 409, r.text
        assert "control_vector" in r.json()["error"] and "re-export" in r.json()["error"]
        assert attention(proc, {"inputs": "hello"}).status_code == 200
        steered_text = httpx.post(f"{proc.url}/generate", timeout=60, json={
            "inputs": "hello", "parameters": {"control_vector": {"name": "v"}}})
        assert steered_text.status_code == 200  # the engine graph still steers
