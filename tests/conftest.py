"""Shared session fixtures: one tiny trained checkpoint and its exported artifact.

Both are built once per test session into pytest's temporary directory, so every test
area (model, export, service, bench) can reuse them without paying for training twice.
The checkpoint is a real one written by ``model.checkpoint.save_checkpoint``: a byte-level
BPE tokenizer trained on ~200 KB of the built-in stdlib corpus (docstrings of the Python
standard library, built from source on first use; nothing outside the repository is read)
and a small GPT trained for 150 AdamW steps (~3 s), enough that greedy decoding is not
stuck on one token.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CORPUS_CHARS = 200_000
TINY_VOCAB = 384
TRAIN_STEPS = 150
TRAIN_BATCH = 16
TRAIN_BLOCK = 64


@pytest.fixture(autouse=True)
def unexpected_step_failures(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test in which the engine (in this process or a server the tests started)
    logged a failed step the test did not inject (tests/step_failures.py)."""
    from tests import step_failures

    watch = step_failures.start()
    yield
    found = step_failures.stop(watch)
    if found and request.node.get_closest_marker("step_failures") is None:
        pytest.fail("the engine logged a failed step this test did not inject (mark it "
                    "step_failures if it does):\n" + "\n".join(found), pytrace=False)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Tiny models gain nothing from threads; on a shared 2-core box extra threads only
    contend (training took 60 s with 2 threads under load, 6 s with 1)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def corpus_text() -> str:
    """The built-in stdlib corpus as plain text (documents joined by blank lines)."""
    from model.data import read_documents, stdlib_corpus_path

    return "\n\n".join(read_documents(stdlib_corpus_path()))


def tiny_corpus() -> str:
    """The first ~200 KB of the stdlib corpus."""
    return corpus_text()[:CORPUS_CHARS]


@pytest.fixture(scope="session")
def stdlib_text() -> str:
    """~1 MB of English technical prose for tests that train or tokenize real text."""
    return corpus_text()


def build_tiny_checkpoint(out_dir: Path, seed: int = 0) -> Path:
    """Train the tiny tokenizer and model inline and save them as a checkpoint."""
    import torch

    from model.checkpoint import CheckpointMeta, save_checkpoint
    from model.config import GPTConfig
    from model.gpt import GPT
    from model.tokenizer import encode, special_ids, train_bpe_tokenizer

    text = tiny_corpus()
    chunks = [text[i:i + 2000] for i in range(0, len(text), 2000)]
    tok = train_bpe_tokenizer(chunks, vocab_size=TINY_VOCAB)
    ids = torch.tensor(encode(tok, text), dtype=torch.long)

    config = GPTConfig(vocab_size=tok.get_vocab_size(), d_model=64, n_heads=4, n_layers=2,
                       d_ff=128, max_seq_len=128)
    torch.manual_seed(seed)
    model = GPT(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    losses: list[float] = []
    for _ in range(TRAIN_STEPS):
        starts = torch.randint(0, len(ids) - TRAIN_BLOCK - 1, (TRAIN_BATCH,), generator=gen)
        x = torch.stack([ids[s:s + TRAIN_BLOCK] for s in starts])  # (B, T)
        y = torch.stack([ids[s + 1:s + TRAIN_BLOCK + 1] for s in starts])  # (B, T)
        loss = model(x, targets=y).loss
        assert loss is not None
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()

    meta = CheckpointMeta(
        model=config,
        tokenizer={"kind": "bpe", **special_ids(tok).to_dict()},
        training={"steps": TRAIN_STEPS, "final_loss": losses[-1], "data": "stdlib",
                  "seed": seed},
    )
    metrics = [{"step": i + 1, "loss": loss_value} for i, loss_value in enumerate(losses)]
    return save_checkpoint(out_dir, model, meta, tok.to_str(), metrics)


@pytest.fixture(scope="module")
def attention_gate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two FIFOs for tests/service/launch_server.py's attention gate (a server started with
    ``ATTNSERVE_TEST_ATTENTION_GATE`` set to this directory): ``entered`` is written when a
    request is inside attention.run, which then waits to read ``release``."""
    directory = tmp_path_factory.mktemp("attention-gate")
    os.mkfifo(directory / "entered")
    os.mkfifo(directory / "release")
    return directory


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trained tiny checkpoint directory (config.json, model.safetensors, tokenizer.json)."""
    with torch_threads(1):
        return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ckpt") / "ckpt")


@pytest.fixture(scope="session")
def tiny_artifact(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The verified fp32 ONNX artifact of ``tiny_checkpoint`` (model.onnx, attention.onnx...)."""
    from export.to_onnx import export_artifact

    out = tmp_path_factory.mktemp("tiny-artifact") / "artifact"
    with torch_threads(1):
        export_artifact(tiny_checkpoint, out)
    return out


@pytest.fixture(scope="session")
def tiny_engine_artifact(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
                         ) -> Path:
    """``tiny_checkpoint`` exported with --engine-graph (engine.onnx, engine_mixed.onnx and
    their adapter graphs), verified: one export read by the export and HTTP tests alike."""
    from export.to_onnx import export_artifact

    out = tmp_path_factory.mktemp("tiny-engine-artifact") / "artifact"
    with torch_threads(1):
        return export_artifact(tiny_checkpoint, out, engine_graph=True)


@pytest.fixture(scope="session")
def served_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A random-weight GPT-2 saved by transformers (12 layers × 12 heads, width 96,
    vocab.json + merges.txt) whose greedy decoding of one prompt ends at <|endoftext|>."""
    pytest.importorskip("transformers")
    from tests.hf_gpt2 import build_served_gpt2

    with torch_threads(1):
        return build_served_gpt2(tmp_path_factory.mktemp("gpt2-hf") / "hf")


@pytest.fixture(scope="session")
def gpt2_checkpoint(served_gpt2: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``served_gpt2`` through `attnserve import`."""
    from model.hf_import import import_hf_checkpoint

    with torch_threads(1):
        return import_hf_checkpoint(served_gpt2.hf_dir,
                                    tmp_path_factory.mktemp("gpt2-ckpt") / "ckpt")


@pytest.fixture(scope="session")
def gpt2_artifact(gpt2_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The verified fp32 artifact of ``gpt2_checkpoint``, engine.onnx included."""
    from export.to_onnx import export_artifact

    out = tmp_path_factory.mktemp("gpt2-artifact") / "artifact"
    with torch_threads(1):
        return export_artifact(gpt2_checkpoint, out, engine_graph=True)


@pytest.fixture(scope="session")
def llama_artifacts(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """family ("llama" | "qwen2") → random-weight HF directory, its import, its verified fp32
    artifact (tests/hf_llama.py); each family built once per session, on first use."""
    from tests.hf_llama import LlamaBuild, build_llama_artifact

    built: dict[str, LlamaBuild] = {}

    def get(family: str) -> LlamaBuild:
        if family not in built:
            with torch_threads(1):
                built[family] = build_llama_artifact(tmp_path_factory.mktemp(family), family)
        return built[family]

    return get


@pytest.fixture(scope="session")
def gguf_ops_library() -> Iterator[Path]:
    """The GGUF op library (service/ops), built once a session (service/ops/build.py: cached,
    a no-op when `make gguf-ops` built it; on a fresh clone it fetches ONNX Runtime's headers
    and the llama-cpp-python sdist into .cache/ and compiles, 0.5-1.5 min on 2 cores), and
    named in $ATTNSERVE_GGUF_OPS for the rest of the session, so every session the tests
    open loads this very build. Tests skip only where it cannot be built on this machine (a
    tool or a download missing), and fail when the build fails."""
    from service.ops import ENV_VAR, build

    try:
        library = build.ensure_built()
    except build.BuildUnavailable as exc:
        pytest.skip(f"the GGUF op library cannot be built on this machine: {exc}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENV_VAR, str(library))
        yield library


@pytest.fixture(scope="session")
def smollm2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real SmolLM2-135M-Instruct GGUF (model/default_model.py) through `attnserve import
    --gguf`: a 30-layer Llama with its ChatML template; skipped when `make default-model`
    has not installed the file."""
    from model.default_model import default_gguf_path, install_hint
    from model.gguf.to_checkpoint import import_gguf_checkpoint

    src = default_gguf_path()
    if not src.is_file():
        pytest.skip(f"SmolLM2 GGUF not installed at {src}: {install_hint()}")
    return import_gguf_checkpoint(src, tmp_path_factory.mktemp("smollm2-ckpt") / "ckpt")


REPO = Path(__file__).resolve().parents[1]
# What `make deploy-model` exports and docker-compose.yml mounts read-only at /models/default.
DEPLOY_MODEL_DIR = REPO / "artifacts" / "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def deploy_model_made() -> list[Path]:
    """What `deploy_model` made with `make deploy-model` in this session (empty: nothing)."""
    return []


@pytest.fixture(scope="session")
def deploy_model(deploy_model_made: list[Path]) -> Path:
    """`make deploy-model`: SmolLM2-135M-Instruct exported (import --gguf, export with the
    engine graph, verified) where docker-compose mounts it; kept in artifacts/, so made once
    per clone. tests/service/test_real_model.py checks that very export when this session
    made it (a fresh clone: CI) instead of exporting the same model a second time."""
    if not (DEPLOY_MODEL_DIR / "manifest.json").is_file():
        proc = subprocess.run(["make", "-s", "deploy-model"], cwd=REPO, capture_output=True,
                              text=True, timeout=1200, check=False)
        if proc.returncode != 0:
            pytest.fail(f"make deploy-model failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
        deploy_model_made.append(DEPLOY_MODEL_DIR)
    return DEPLOY_MODEL_DIR


@pytest.fixture(scope="session")
def smollm2_transformers() -> tuple[Any, Any]:
    """transformers' own model and tokenizer read from the same GGUF file: the reference
    the real model is checked against (float32, eager attention so output_attentions holds
    the weights); loaded once per session (~15 s)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from model.default_model import default_gguf_path, install_hint

    path = default_gguf_path()
    if not path.is_file():
        pytest.skip(f"SmolLM2 GGUF not installed at {path}: {install_hint()}")
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32,
        attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
