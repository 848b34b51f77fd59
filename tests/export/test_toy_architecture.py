"""Adding an architecture is one module plus its registration.

The toy family below is GPT-2 with a squared-ReLU feed-forward layer (Primer, So et al.
2021; Nemotron-4 uses it): its whole definition is the class in this file, registered at
run time, plus its one exception for the ONNX writer, the new activation's nodes (an
entry in export/onnx/layers.py's ACTIVATIONS). A random model of it goes through the
normal paths — checkpoint, `attnserve export` with --engine-graph (which verifies
model.onnx and engine.onnx against PyTorch itself) — and the test then compares ONNX
Runtime's logits with the PyTorch model's on its own, with a numpy reference for the new
activation.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from export.onnx import layers
from export.onnx.onnx_build import Graph
from model.architectures import UnknownArchitecture, architecture, register, unregister
from model.architectures.base import ModelConfig
from model.architectures.gpt2 import Gpt2
from model.checkpoint import CheckpointMeta, load_checkpoint, save_checkpoint
from model.config import GPTConfig
from model.gpt import GPT
from model.tokenizer import build_char_tokenizer, special_ids


class SquaredReLU(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(x).square()


class Gpt2Relu2(Gpt2):
    """GPT-2 blocks with relu(x)² as the feed-forward activation; nothing else differs."""

    name = "toy-relu2"
    hf_model_types = ()
    gguf_names = ()
    activations = ("relu2",)

    def activation(self, config: ModelConfig) -> nn.Module:
        return SquaredReLU()


def relu2_nodes(g: Graph, x: str, name: str) -> str:
    """relu(x)² in standard ONNX operators, for every graph the export writes."""
    r = g.one("Relu", [x], f"{name}.relu")
    return g.one("Mul", [r, r], name)


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gpt2Relu2]:
    arch = register(Gpt2Relu2())
    monkeypatch.setitem(layers.ACTIVATIONS, "relu2", relu2_nodes)
    yield arch
    unregister(arch.name)


def toy_checkpoint(out: Path) -> tuple[Path, GPT]:
    text = "attention is all you need; the keys and values are cached. " * 4
    tok = build_char_tokenizer([text])
    config = GPTConfig(vocab_size=tok.get_vocab_size(), d_model=32, n_heads=4, n_layers=2,
                       d_ff=64, max_seq_len=48, arch="toy-relu2", activation="relu2",
                       attn_bias=True)
    torch.manual_seed(0)
    model = GPT(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # weights well away from N(0, 0.02): logits with a real spread
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    meta = CheckpointMeta(model=config, tokenizer={"kind": "char", **special_ids(tok).to_dict()})
    return save_checkpoint(out, model, meta, tok.to_str()), model


def test_unknown_architecture_names_the_registered_ones(toy: Gpt2Relu2) -> None:
    with pytest.raises(UnknownArchitecture, match="'mamba'; registered: gpt, llama, toy-relu2"):
        architecture("mamba")
    with pytest.raises(ValueError, match="activation"):
        GPTConfig(vocab_size=8, arch="toy-relu2", activation="relu")
    assert architecture("toy-relu2") is toy


def test_the_torch_module_computes_squared_relu(toy: Gpt2Relu2) -> None:
    config = GPTConfig(vocab_size=8, d_model=8, n_heads=2, n_layers=1, d_ff=16,
                       arch="toy-relu2", activation="relu2")
    model = GPT(config)
    ffn: Any = model.blocks[0].ffn
    x = torch.linspace(-3, 3, 13)
    assert torch.equal(ffn.act(x), torch.from_numpy(np.maximum(x.numpy(), 0) ** 2))
    assert model.num_params() == config.num_params_closed_form()


@torch.no_grad()
def test_toy_architecture_exports_and_onnx_runtime_matches_pytorch(
        toy: Gpt2Relu2, tmp_path: Path) -> None:
    from export.to_onnx import export_artifact
    from export.verify.engine_parity import EngineDecoder
    from service.contract import io_spec as io
    from service.contract.engine_spec import ENGINE_FILE
    from service.contract.sessions import create_session

    ckpt, model = toy_checkpoint(tmp_path / "ckpt")
    assert load_checkpoint(ckpt).meta.model.arch == "toy-relu2"
    art = export_artifact(ckpt, tmp_path / "art", engine_graph=True)  # verifies both graphs
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))
    expected = model(ids).logits.numpy()  # (B, T, V)

    session = create_session(art / io.MODEL_FILE)
    empty = np.zeros((2, cfg.kv_heads, 0, cfg.head_dim), np.float32)
    feed: dict[str, np.ndarray] = {
        io.INPUT_IDS: ids.numpy(), io.ATTENTION_MASK: np.ones((2, 11), np.int64),
        io.POSITION_IDS: np.tile(np.arange(11, dtype=np.int64), (2, 1)),
        **{name: empty for name in io.past_names(cfg.n_layers)}}
    logits = session.run([io.LOGITS], feed)[0]
    scale = float(np.abs(expected).max())
    assert scale > 1.0  # a real spread, so the comparison below means something
    assert np.abs(logits - expected).max() <= 1e-4 * scale

    engine = EngineDecoder(art / ENGINE_FILE, model)
    pos = np.tile(np.arange(11, dtype=np.int64), (2, 1))
    engine_logits, _ = engine(ids.numpy(), np.ones((2, 11), np.int64), pos,
                              engine.empty_past(2))
    assert np.abs(engine_logits - expected).max() <= 1e-4 * scale
