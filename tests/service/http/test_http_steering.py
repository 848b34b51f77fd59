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
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from model.checkpoint import load_checkpoint
from model.steering import steered
from service.contract.control_vector import ControlVector, write_control_vector
from tests.conftest import torch_threads
from tests.export.test_steer import FLOAT32, PAIRS, ours_greedy, write_pairs
from tests.service.helpers import ServerProcess, metric_value, serving, wait_metric

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
