"""Service test fixtures: artifacts, the greedy reference and real server subprocesses
(the helpers they use are in tests/service/helpers.py)."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from service.contract import io_spec as io
from service.contract.engine_spec import ENGINE_FILE
from tests.service.helpers import ServerProcess, greedy_loop, metric_value, record_graphs


@pytest.fixture(scope="session")
def artifact(tiny_artifact: Path) -> Path:
    return tiny_artifact


@pytest.fixture(scope="session")
def tokenizer(artifact: Path) -> Tokenizer:
    return Tokenizer.from_file(str(artifact / io.TOKENIZER_FILE))


@pytest.fixture(scope="session")
def encode(tokenizer: Tokenizer) -> Callable[[str], list[int]]:
    return lambda text: list(tokenizer.encode(text, add_special_tokens=False).ids)


@pytest.fixture(scope="session")
def int4_artifact(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint exported with --quantize int4 --engine-graph --float32-twin
    (engine_float32.onnx beside the 4-bit graphs), unverified."""
    from export.to_onnx import export_artifact
    from tests.conftest import torch_threads

    with torch_threads(1):
        return export_artifact(tiny_checkpoint, tmp_path_factory.mktemp("int4") / "artifact",
                               quantize="int4", engine_graph=True, verify=False,
                               float32_twin=True)


@pytest.fixture(scope="session")
def engine_artifact(artifact: Path, tiny_checkpoint: Path,
                    tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny artifact plus engine.onnx (built here with torch; servers never import it)."""
    from export.onnx.engine_graph import export_engine
    from model.checkpoint import load_checkpoint

    out = tmp_path_factory.mktemp("engine") / "artifact"
    shutil.copytree(artifact, out)
    export_engine(load_checkpoint(tiny_checkpoint).model.eval(), out / ENGINE_FILE)
    return record_graphs(out)


@pytest.fixture(scope="session")
def mixed_engine_path(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """engine.onnx of the tiny model with a second group of rows (``chunk.*``): a prompt
    chunk and the decode rows in one pass."""
    from export.onnx.engine_graph import export_engine
    from model.checkpoint import load_checkpoint

    path = tmp_path_factory.mktemp("mixed-engine") / ENGINE_FILE
    return export_engine(load_checkpoint(tiny_checkpoint).model.eval(), path, mixed=True)


@pytest.fixture(scope="session")
def reference_greedy(artifact: Path) -> Callable[[list[int], int], list[int]]:
    """The greedy reference over the tiny artifact (see ``greedy_loop``)."""
    return greedy_loop(artifact)


@pytest.fixture(scope="module")
def start_server(artifact: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[Callable[..., ServerProcess]]:
    """Factory: start a server (ready on return); every one is stopped at module end."""
    servers: list[ServerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None, wait: bool = True,
              gate: bool = False, model: Path | None = None) -> ServerProcess:
        log = tmp_path_factory.mktemp("server") / "server.log"
        server = ServerProcess(model or artifact, log, args, env, gate)
        servers.append(server)
        if wait:
            server.wait_ready()
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def metric() -> Callable[..., float]:
    return metric_value



@pytest.fixture(scope="session")
def lora_build(llama_artifacts: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """tests/service/lora_build.py: the tiny Llama's artifact with adapter graphs, two PEFT
    adapters and their merged models."""
    pytest.importorskip("peft")
    from tests.service.lora_build import build_lora

    return build_lora(llama_artifacts("llama"), tmp_path_factory.mktemp("lora"))
