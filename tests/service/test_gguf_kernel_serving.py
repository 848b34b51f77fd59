"""Serving an artifact whose graphs compute a GGUF file's bytes with ggml's kernels
(`attnserve export --quantize gguf --kernel ggml`; GgufMatMul / GgufGather, service/ops).

A small random Llama written as a Q4_1 GGUF file (the default model's type; tests/export/
test_gguf_blocks.py builds it), imported and exported with --kernel ggml, served by a real
server process. The reference is the plain greedy loop over the same artifact's model.onnx
by the contract's names (tests/service/helpers.py ``greedy_loop``): one row at a time, the
past fed back, sharing no code with the engine, whose batched steps (engine_mixed.onnx,
several rows a product) must give the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import torch_threads
from tests.service.helpers import ServerProcess, greedy_loop

pytest.importorskip("gguf")
pytest.importorskip("transformers")

PROMPTS = ["The quick brown fox", "hello hello hello", "a", "Once upon a time there", "xyz"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def artifact(gguf_ops_library: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Overrides tests/service/conftest.py's: the Q4_1 model exported with --kernel ggml, its
    cache float32 as model.onnx's, so that the plain loop over model.onnx is the reference
    (the float16 cache's served tokens: test_half_cache_serving.py)."""
    from export.to_onnx import export_artifact
    from model.gguf.to_checkpoint import import_gguf_checkpoint
    from tests.export.test_gguf_blocks import CASES, write_file

    root = tmp_path_factory.mktemp("ggml-kernel")
    ckpt = import_gguf_checkpoint(write_file(root, CASES["q4_1"]), root / "ckpt")
    with torch_threads(1):
        return export_artifact(ckpt, root / "artifact", quantize="gguf", engine_graph=True,
                               verify=False, kernel="ggml", kv_dtype="float32")


@pytest.fixture(scope="module")
def server(start_server: Callable[..., ServerProcess], gguf_ops_library: Path) -> ServerProcess:
    # the library this session built: a server finds it by itself too (service/ops), but
    # the test must not depend on the cache's state
    return start_server("--max-batch-size", "4",
                        env={"ATTNSERVE_GGUF_OPS": str(gguf_ops_library)})


def generate(url: str, prompt: str) -> tuple[list[int], list[int]]:
    """(the prompt's token ids, the greedy tokens) from /generate."""
    r = httpx.post(f"{url}/generate", json={"inputs": prompt, "parameters": {
        "max_new_tokens": NEW_TOKENS, "details": True, "decoder_input_details": True}},
        timeout=120)
    assert r.status_code == 200, r.text
    details = r.json()["details"]
    return [t["id"] for t in details["prefill"]], [t["id"] for t in details["tokens"]]


def test_info_and_the_log_name_the_kernels(server: ServerProcess,
                                           gguf_ops_library: Path) -> None:
    info = httpx.get(f"{server.url}/info", timeout=30).json()
    assert info["decode_graph"] == "engine_mixed.onnx"
    assert info["kernel"] == {"weights": "ggml", "library": str(gguf_ops_library),
                              "attention": "CachedAttention"}
    assert {g["kernel"] for g in info["graphs"]} == {"ggml"}
    assert "GGUF blocks computed by ggml's CPU kernels inside ONNX Runtime" in server.log()
    assert "attention: CachedAttention" in server.log()


def test_batched_greedy_tokens_equal_the_plain_loop(server: ServerProcess,
                                                    artifact: Path) -> None:
    """Five prompts at once (decode steps of several rows through each GgufMatMul, prompts
    riding in them) and one alone: each row's greedy tokens are the plain loop's."""
    reference = greedy_loop(artifact)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: generate(server.url, p), PROMPTS))
    for ids, tokens in got:
        assert ids and tokens == reference(ids, NEW_TOKENS)
    assert generate(server.url, PROMPTS[0]) == got[0]


@pytest.fixture(scope="module")
def dequantised_server(start_server: Callable[..., ServerProcess],
                       tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    """The same artifact where the op library cannot load (here: a file that is no
    library; on a host, one not built or built for another CPU)."""
    not_a_library = tmp_path_factory.mktemp("no-ops") / "libattnserve_gguf_ops.so"
    not_a_library.write_bytes(b"")
    return start_server("--max-batch-size", "4", env={"ATTNSERVE_GGUF_OPS": str(not_a_library)})


def test_without_the_library_the_blocks_serve_dequantised(dequantised_server: ServerProcess,
                                                          artifact: Path) -> None:
    """/info, the metrics and the log say so; the greedy tokens are the float32 model's:
    PyTorch on the imported checkpoint, whose weights are the file's blocks dequantised."""
    import torch

    from model.checkpoint import load_checkpoint

    url = dequantised_server.url
    info = httpx.get(f"{url}/info", timeout=30).json()
    assert info["kernel"] == {"weights": "dequantised", "library": None,
                              "attention": "GroupQueryAttention"}
    assert 'kernel="dequantised"' in httpx.get(f"{url}/metrics", timeout=30).text
    assert "GGUF blocks dequantised to float32" in dequantised_server.log()
    gpt = load_checkpoint(artifact.parent / "ckpt").model.eval()
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: generate(url, p), PROMPTS))
    for ids, tokens in got:
        row = list(ids)
        with torch.no_grad(), torch_threads(1):
            for _ in range(NEW_TOKENS):
                row.append(int(gpt(torch.tensor([row])).logits[0, -1].argmax()))
        assert tokens == row[len(ids):]


def test_attention_without_the_library_equals_the_librarys(dequantised_server: ServerProcess,
                                                           server: ServerProcess) -> None:
    """/attention (attention.onnx at float activations, whole and cut to one layer) on the
    dequantised copy equals the op library's over the same blocks."""
    for body in ({"inputs": PROMPTS[3]}, {"inputs": PROMPTS[3], "layers": [1], "heads": [0]}):
        got, want = (httpx.post(f"{s.url}/attention", json=body, timeout=120)
                     for s in (dequantised_server, server))
        assert got.status_code == want.status_code == 200, (got.text, want.text)
        assert got.json()["shapes"] == want.json()["shapes"]
        np.testing.assert_allclose(np.asarray(got.json()["attention"]["weights"]),
                                   np.asarray(want.json()["attention"]["weights"]), atol=1e-5)
