"""Control vectors loaded and unloaded at run time (--runtime-control-vectors): behind the
API key, only from under --control-vector-dir, a bad file refused with nothing loaded; a
loaded vector steers requests as the PyTorch reference steered by it (model/steering.py),
an unloaded one is a 404 again; without the setting the routes do not exist."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from model.checkpoint import load_checkpoint
from model.steering import steered
from service.contract.control_vector import ControlVector, write_control_vector
from tests.service.helpers import ServerProcess, serving

KEY = "steer-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
WIDTH = 64  # the tiny model's
DIRECTION = {1: np.random.default_rng(5).standard_normal(WIDTH).astype(np.float32)}


@pytest.fixture(scope="module")
def vector_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vectors")
    (root / "inside").mkdir()
    write_control_vector(ControlVector(DIRECTION), root / "inside" / "good.gguf")
    write_control_vector(ControlVector({1: np.ones(32, np.float32)}),
                         root / "inside" / "narrow.gguf")
    write_control_vector(ControlVector(DIRECTION), root / "outside.gguf")
    os.symlink(root / "outside.gguf", root / "inside" / "link.gguf")
    return root


@pytest.fixture(scope="module")
def server(engine_artifact: Path, vector_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from serving(engine_artifact, tmp_path_factory.mktemp("log") / "server.log",
                       ("--runtime-control-vectors", "--control-vector-dir",
                        str(vector_dir / "inside"), "--no-prefix-caching"),
                       env={"ATTNSERVE_API_KEY": KEY})


def post(server: ServerProcess, path: str, body: dict, key: bool = True) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH if key else {},
                      timeout=60)


def generate(server: ServerProcess, control: dict) -> httpx.Response:
    return post(server, "/generate", {"inputs": "ROMEO:", "parameters": {
        "max_new_tokens": 8, "details": True, "control_vector": control}})


def reference(tiny_checkpoint: Path, ids: list[int], scale: float, n: int = 8) -> list[int]:
    from model.sample import generate as sample

    model = load_checkpoint(tiny_checkpoint).model.eval()
    with steered(model, DIRECTION, scale), torch.no_grad():
        return sample(model, torch.tensor([ids]), n, greedy=True
                      ).sequences[0, len(ids):].tolist()


def test_load_steer_and_unload(server: ServerProcess, tiny_checkpoint: Path) -> None:
    assert post(server, "/v1/load_control_vector", {"name": "g", "path": "good.gguf"},
                key=False).status_code == 401
    assert generate(server, {"name": "g", "scale": 2.0}).status_code == 404
    loaded = post(server, "/v1/load_control_vector", {"name": "g", "path": "good.gguf"})
    assert loaded.status_code == 200 and loaded.json() == {"name": "g", "layers": [1]}
    assert httpx.get(f"{server.url}/info", headers=AUTH).json()["control_vectors"] == ["g"]
    answer = generate(server, {"name": "g", "scale": 2.0})
    assert answer.status_code == 200, answer.text
    tokens = [t["id"] for t in answer.json()["details"]["tokens"]]
    ids = [t["id"] for t in post(server, "/tokenize", {"inputs": "ROMEO:"}).json()]
    want = reference(tiny_checkpoint, ids, 2.0)
    assert tokens == want[:len(tokens)] and tokens
    assert want != reference(tiny_checkpoint, ids, 0.0)  # the vector matters at this scale
    again = post(server, "/v1/load_control_vector", {"name": "g", "path": "good.gguf"})
    assert again.status_code == 400
    assert post(server, "/v1/unload_control_vector", {"name": "g"}).status_code == 200
    assert generate(server, {"name": "g", "scale": 2.0}).status_code == 404
    gone = post(server, "/v1/unload_control_vector", {"name": "g"})
    assert gone.status_code == 404


@pytest.mark.parametrize(("path", "reason"), [
    ("narrow.gguf", "width 32"), ("link.gguf", "leads outside"),
    ("../outside.gguf", "leads outside"), ("missing.gguf", "does not exist")])
def test_bad_files_are_refused_and_nothing_is_loaded(server: ServerProcess, path: str,
                                                     reason: str) -> None:
    refused = post(server, "/v1/load_control_vector", {"name": "bad", "path": path})
    assert refused.status_code == 400 and reason in refused.json()["error"]["message"]
    info = httpx.get(f"{server.url}/info", headers=AUTH).json()
    assert "bad" not in info["control_vectors"]


def test_without_the_setting_the_routes_do_not_exist(engine_artifact: Path,
                                                     tmp_path: Path) -> None:
    for plain in serving(engine_artifact, tmp_path / "server.log"):
        assert post(plain, "/v1/load_control_vector", {"name": "g", "path": "x"}
                    ).status_code == 404


def test_a_graph_exported_before_steer_refuses_vectors_at_start(
        engine_artifact: Path, tiny_checkpoint: Path, vector_dir: Path, tmp_path: Path) -> None:
    import shutil
    import subprocess
    import sys

    import onnx

    from export.onnx.engine_graph import build_engine_graph
    from service.contract.engine_spec import ENGINE_FILE
    from tests.service.helpers import record_graphs

    old = tmp_path / "artifact"
    shutil.copytree(engine_artifact, old)
    model = load_checkpoint(tiny_checkpoint).model.eval()
    onnx.save_model(build_engine_graph(model, steering=False), str(old / ENGINE_FILE))
    record_graphs(old)
    result = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--model", str(old),
                             "--port", "0", "--control-vectors",
                             f"g={vector_dir / 'inside' / 'good.gguf'}"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "engine.onnx takes no steer input" in result.stderr
    assert result.stderr.count("\n") == 1  # one line, no traceback
