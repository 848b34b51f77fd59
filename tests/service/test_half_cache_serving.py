"""A float16 KV cache in the CPU engine graphs over the GGUF ops (`attnserve export
--quantize gguf --kernel ggml --kv-dtype float16`; export/gguf/half_cache.py).

The small random Q4_1 Llama of tests/export/test_gguf_blocks.py, exported twice from one
checkpoint: with the float16 cache and with the float32 one. The references are plain
loops written here over the artifacts' own engine.onnx by the contract's names (one row,
numpy caches of the graph's type fed and read back, no engine code): the served batched
tokens must be the float16 graph's own loop's, and the two graphs' logits must stay within
what rounding keys and values to float16 moves them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from service.contract import engine_spec as es
from service.contract import io_spec as io
from tests.conftest import torch_threads
from tests.service.helpers import ServerProcess
from tests.service.test_gguf_kernel_serving import PROMPTS, generate

pytest.importorskip("gguf")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from model.gguf.to_checkpoint import import_gguf_checkpoint
    from tests.export.test_gguf_blocks import CASES, write_file

    root = tmp_path_factory.mktemp("half-cache")
    return import_gguf_checkpoint(write_file(root, CASES["q4_1"]), root / "ckpt")


def exported(checkpoint: Path, out: Path, kv_dtype: str) -> Path:
    from export.to_onnx import export_artifact

    with torch_threads(1):  # verified: the served graph judged against the float32 cache's
        return export_artifact(checkpoint, out, quantize="gguf", engine_graph=True,
                               kernel="ggml", kv_dtype=kv_dtype)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def artifact(gguf_ops_library: Path, checkpoint: Path) -> Path:
    """Overrides tests/service/conftest.py's: the float16 cache's artifact."""
    return exported(checkpoint, checkpoint.parent / "half", "float16")  # (the default too)


@pytest.fixture(scope="module")
def float32_cache(gguf_ops_library: Path, checkpoint: Path) -> Path:
    return exported(checkpoint, checkpoint.parent / "float", "float32")


@pytest.fixture(scope="module")
def server(start_server: Callable[..., ServerProcess], gguf_ops_library: Path) -> ServerProcess:
    return start_server("--max-batch-size", "4",
                        env={"ATTNSERVE_GGUF_OPS": str(gguf_ops_library)})


class PlainLoop:
    """engine.onnx of ``artifact`` by the contract's names, one row at a time: the caches
    (1, N_kv, C, H) of the graph's own input type, fed as inputs and read back from the
    presents (not bound in place, as the engine binds them)."""

    def __init__(self, artifact: Path, library: Path) -> None:
        options = ort.SessionOptions()
        options.register_custom_ops_library(str(library))
        options.intra_op_num_threads = 1
        self.session = ort.InferenceSession(str(artifact / es.ENGINE_FILE), options,
                                            providers=["CPUExecutionProvider"])
        self.config = io.ArtifactConfig.load(artifact)
        past = {i.name: i.type for i in self.session.get_inputs()}[io.past_names(1)[0]]
        self.dtype = np.float16 if past == "tensor(float16)" else np.float32

    def logits(self, ids: list[int], new: int) -> tuple[np.ndarray, list[int]]:
        """(the prompt pass's logits (T, V), then ``new`` greedy tokens)."""
        c = self.config
        capacity = len(ids) + new
        caches = [np.zeros((1, c.kv_heads, capacity, c.head_dim), self.dtype)
                  for _ in io.past_names(c.n_layers)]
        fed, total, tokens = list(ids), 0, []
        first: np.ndarray | None = None
        for _ in range(new):
            t = len(fed)
            feed = es.engine_feed(np.array([fed]), np.arange(total, total + t)[None],
                                  np.array([total + t - 1]), total + t, np.arange(t)[None])
            feed.update(zip(io.past_names(c.n_layers), caches, strict=True))
            out = self.session.run([io.LOGITS, *io.present_names(c.n_layers)], feed)
            logits, caches = out[0][0], out[1:]  # (t, V)
            first = logits if first is None else first
            total += t
            fed = [int(logits[-1].argmax())]
            tokens.append(fed[0])
        assert first is not None
        return first, tokens


def test_only_the_engine_graphs_take_a_float16_cache(artifact: Path) -> None:
    manifest = json.loads((artifact / io.MANIFEST_FILE).read_text())
    table = {g["file"]: g["kv_dtype"] for g in manifest["graphs"]}
    assert table == {io.MODEL_FILE: "float32", es.ENGINE_FILE: "float16",
                     es.ENGINE_MIXED_FILE: "float16", "engine_lora.onnx": "float16",
                     "engine_mixed_lora.onnx": "float16"}
    assert manifest["kv_dtype"] == "float32"  # model.onnx's contract
    assert manifest["verification"]["engine_quantized"]["kv_dtype"] == "float16"
    half, single = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    for file, want in table.items():
        graph = onnx.load(str(artifact / file), load_external_data=False).graph
        caches = [v.type.tensor_type.elem_type for v in (*graph.input, *graph.output)
                  if v.name.startswith(("past_key_values.", "present.", "chunk.past",
                                        "chunk.present"))]
        assert caches and set(caches) == {half if want == "float16" else single}, file


def test_float16_cache_logits_near_the_float32_caches(artifact: Path, float32_cache: Path,
                                                      gguf_ops_library: Path) -> None:
    """The same blocks, one cache rounded: the prompt pass's logits move by a few percent
    (the rounding, then the int8 activations' own rounding of what it moved: 1.7% on
    average, 2% at most, here), where a cache read wrongly moves them by their size."""
    half, single = (PlainLoop(a, gguf_ops_library) for a in (artifact, float32_cache))
    assert (half.dtype, single.dtype) == (np.float16, np.float32)
    ids = list(range(3, 40))
    got, _ = half.logits(ids, 1)  # (T, V)
    want, _ = single.logits(ids, 1)
    moved = np.abs(got - want)
    assert float(moved.mean()) <= 0.05 * float(np.abs(want).mean())
    assert float(moved.max()) <= 0.1 * float(np.abs(want).max())
    assert not np.array_equal(got, want)  # the cache really is rounded


def test_batched_greedy_tokens_equal_the_graphs_own_loop(server: ServerProcess, artifact: Path,
                                                         gguf_ops_library: Path) -> None:
    """Five prompts at once through the float16 pool (batched decode steps, prompts riding
    in them: engine_mixed.onnx) give each row the tokens of the plain loop over engine.onnx."""
    loop = PlainLoop(artifact, gguf_ops_library)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        served = list(pool.map(lambda p: generate(server.url, p), PROMPTS))
    for prompt, (ids, tokens) in zip(PROMPTS, served, strict=True):
        _, expected = loop.logits(ids, len(tokens))
        assert tokens == expected, prompt
    info = httpx.get(f"{server.url}/info", timeout=30).json()
    assert info["decode_graph"] == es.ENGINE_MIXED_FILE
    assert {g["file"]: g["kv_dtype"] for g in info["graphs"]}[es.ENGINE_MIXED_FILE] == "float16"
