"""model/finetune/frozen.py: GGUF blocks held as codes compute what gguf dequantises.

The reference for every weight is gguf's own ``gguf.quants.dequantize`` of the tensor's
bytes, written here with GGUFWriter and read back with GGUFReader (gguf's quantiser's
blocks for Q4_0-Q8_0, valid random blocks for the K-quants it cannot quantise:
tests/gguf_files.py). Layers are checked against plain torch on that weight (forward and
autograd's gradient); the frozen model of small Llama, Qwen2 (tied, biased, with an F16
matrix) and GPT-2 (fused Q|K|V) GGUF checkpoints against the float32 model the checkpoint
loads (each weight dequantised by gguf), logits and the gradient through every layer.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from model.checkpoint import load_checkpoint, read_meta
from model.finetune.frozen import FrozenEmbedding, FrozenLinear, HeldBlocks, frozen_gguf_model
from model.gguf.codes import DIRECT, read_blocks
from model.gguf.to_checkpoint import import_gguf_checkpoint
from tests.conftest import torch_threads
from tests.gguf_files import Q, TokenizerSpec, encode_tensor, random_k_blocks, write_gguf
from tests.hf_llama import IM_END, IM_START, build_hf_model

ROWS, COLS = 8, 512  # two K-quant super-blocks a row
FOUR_BIT = {Q.Q4_0, Q.Q4_1, Q.Q2_K, Q.Q3_K, Q.Q4_K}  # codes of at most 4 bits: two a byte
TYPES = sorted(DIRECT, key=lambda t: t.name)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices gain nothing from threads; on a shared 2-core box they contend."""
    with torch_threads(1):
        yield


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, Q]]) -> dict[str, gguf.ReaderTensor]:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


@pytest.fixture(scope="module")
def tensors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, gguf.ReaderTensor]:
    """Every DIRECT type's (ROWS, COLS) tensor; the K-quants also as blocks whose every
    byte is random (uncentred minimums, any sub-block scale)."""
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((ROWS, COLS)).astype(np.float32) * 0.05
    made = {t.name: (encode_tensor(weights, t, rng), t) for t in TYPES}
    for t in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K):
        made[f"{t.name}.raw"] = (random_k_blocks((ROWS, COLS), t, rng, centred=False), t)
    return _write(tmp_path_factory.mktemp("held") / "blocks.gguf", made)


def reference(tensor: gguf.ReaderTensor) -> torch.Tensor:
    """gguf's float32 weight (N, K)."""
    w = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    assert w.shape == (ROWS, COLS) and np.isfinite(w).all()
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))


def names() -> list[str]:
    return [t.name for t in TYPES] + [f"{t.name}.raw" for t in TYPES if t.name.endswith("_K")]


@pytest.mark.parametrize("name", names())
def test_held_blocks_dequantise_to_ggufs_values(name: str, tensors) -> None:
    tensor = tensors[name]
    held = HeldBlocks(read_blocks(tensor))
    w = reference(tensor)
    assert held.shape == (ROWS, COLS)
    got = held.dequantize()
    assert got.dtype == torch.float32
    assert torch.equal(got, w)
    rows = torch.tensor([[3, 0, 3], [7, 7, 1]])
    assert torch.equal(held.dequantize(rows), w[rows])  # (2, 3, K), repeats included
    assert torch.equal(held.dequantize(torch.tensor([5])), w[5:6])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_held_blocks_keep_codes_not_floats(qtype: Q, tensors) -> None:
    """uint8 codes, two a byte for 4-bit types; no float32 copy of the weight anywhere."""
    held = HeldBlocks(read_blocks(tensors[qtype.name]))
    assert held.codes.dtype == torch.uint8
    assert held.codes.numel() == ROWS * COLS // (2 if qtype in FOUR_BIT else 1)
    assert held.scales.dtype == torch.float32
    assert not any(b.is_floating_point() and b.numel() >= ROWS * COLS for b in held.buffers())
    expected = held.codes.numel() + 4 * held.scales.numel()
    expected += 0 if held.mins is None else 4 * held.mins.numel()
    assert held.nbytes() == expected < 4 * ROWS * COLS


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K],
                         ids=lambda t: t.name)
def test_frozen_linear_matches_a_plain_linear(qtype: Q, tensors) -> None:
    tensor = tensors[qtype.name]
    w = reference(tensor)
    bias = torch.randn(ROWS, generator=torch.Generator().manual_seed(1))
    layer = FrozenLinear(HeldBlocks(read_blocks(tensor)), bias)
    assert (layer.out_features, layer.in_features) == (ROWS, COLS)
    assert list(layer.parameters()) == []
    assert not any(b.requires_grad for b in layer.buffers())

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, COLS, generator=gen, requires_grad=True)
    g = torch.randn(3, 5, ROWS, generator=gen)
    y = layer(x)
    torch.testing.assert_close(y, x @ w.T + bias, rtol=1e-5, atol=1e-5)
    (grad,) = torch.autograd.grad(y, x, g)
    x_ref = x.detach().clone().requires_grad_(True)
    (grad_ref,) = torch.autograd.grad(F.linear(x_ref, w, bias), x_ref, g)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-5, atol=1e-5)

    # twice, through separate forwards: the gradients accumulate in x; none reach the blocks
    for _ in range(2):
        (layer(x) * g).sum().backward()
    torch.testing.assert_close(x.grad, 2 * grad_ref, rtol=1e-5, atol=1e-5)
    assert all(b.grad is None for b in layer.buffers())


def test_frozen_linear_saves_no_float_weight_for_backward(tensors) -> None:
    """Autograd keeps nothing of the weight's size between the forward and the backward
    (a plain F.linear saves W: the hook sees it, so it would see a kept copy)."""
    tensor = tensors[Q.Q4_K.name]
    layer = FrozenLinear(HeldBlocks(read_blocks(tensor)), None)
    x = torch.randn(2, COLS, requires_grad=True)

    def saved_by(fn) -> list[torch.Tensor]:
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                      lambda t: t):
            fn().sum().backward()
        return saved

    w = reference(tensor).requires_grad_(False)
    assert any(t.numel() == ROWS * COLS for t in saved_by(lambda: F.linear(x, w)))
    assert not any(t.numel() >= ROWS * COLS for t in saved_by(lambda: layer(x)))
    assert layer.bias is None


def test_frozen_linear_in_float64(tensors) -> None:
    tensor = tensors[Q.Q6_K.name]
    layer = FrozenLinear(HeldBlocks(read_blocks(tensor)), None)
    w = reference(tensor).double()
    x = torch.randn(4, COLS, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, x @ w.T, rtol=1e-12, atol=1e-12)
    (grad,) = torch.autograd.grad(y.sum(), x)
    assert grad.dtype == torch.float64
    torch.testing.assert_close(grad, w.sum(0).expand(4, COLS), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q5_0, Q.Q3_K, Q.Q6_K], ids=lambda t: t.name)
def test_frozen_embedding_looks_rows_up(qtype: Q, tensors) -> None:
    tensor = tensors[qtype.name]
    emb = FrozenEmbedding(HeldBlocks(read_blocks(tensor)))
    assert (emb.num_embeddings, emb.embedding_dim) == (ROWS, COLS)
    ids = torch.tensor([[0, 7, 7, 2], [5, 1, 0, 3]])
    assert torch.equal(emb(ids), reference(tensor)[ids])


# -- the frozen model of a GGUF checkpoint --------------------------------------------------
K_SIZED = {"hidden_size": 256, "intermediate_size": 512}  # K-quants: rows of 256
# (family, tied, types the matrices take in turn: llama's first is output.weight, a tied
# qwen2's token_embd.weight, so the embedding is Q4_K in both; GPT-2's fused attn_qkv is
# cut into three FrozenLinears and its position table is a FrozenEmbedding too)
CHECKPOINTS = {"llama-untied": ("llama", False, (Q.Q8_0, Q.Q4_K, Q.Q6_K)),
               "qwen2-tied-f16": ("qwen2", True, (Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.F16)),
               "gpt2-untied": ("gpt2", False, (Q.Q8_0, Q.Q5_0, Q.Q4_1))}
# held bytes a weight, by hand: 8-bit codes (Q5_0's too) a byte, 4-bit ones half; a float32
# scale per block (32 weights, Q6_K's 16) and, with minimums, a float32 minimum
RATE = {Q.Q8_0: 1 + 4 / 32, Q.Q5_0: 1 + 4 / 32, Q.Q4_1: 0.5 + 8 / 32, Q.Q4_K: 0.5 + 8 / 32,
        Q.Q6_K: 1 + 4 / 16}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    family, tied, types = CHECKPOINTS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    if family == "gpt2":
        from tests.hf_gpt2 import build_hf_model as build_gpt2

        build_gpt2(root / "hf", seed=3, n_embd=64, tie_word_embeddings=tied)
        spec = TokenizerSpec(pre="gpt-2", bos="<|endoftext|>", eos="<|endoftext|>")
    else:
        build_hf_model(root / "hf", family, seed=3, tie_word_embeddings=tied, **K_SIZED)
        spec = TokenizerSpec(pre="gpt-2", bos=IM_START, eos=IM_END, pad=IM_END, add_bos=True)
    path = write_gguf(root / "hf", root / "model.gguf", types, spec)
    return path, import_gguf_checkpoint(path, root / "ckpt"), request.param


def test_frozen_gguf_model_computes_the_float32_checkpoint(checkpoint) -> None:
    path, ckpt, case = checkpoint
    model, held_bytes = frozen_gguf_model(ckpt, read_meta(ckpt).model)
    reference_model = load_checkpoint(ckpt).model.eval()
    model.eval()

    ids = torch.tensor([[1, 5, 9, 200, 399, 17], [42, 0, 3, 3, 250, 128]])
    with torch.no_grad():
        got = model(ids).logits
        want = reference_model(ids).logits
    assert got.shape == (2, 6, 400)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

    # the gradient at the embeddings' output (what LoRA layers above them pass back through);
    # addmm's fused bias (Qwen2's Q/K/V) rounds otherwise than FrozenLinear's y + b
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(4))
    grads = [_embedding_grad(m, ids, g) for m in (model, reference_model)]
    scale = float(grads[1].abs().max())  # in the hundreds: float32 rounding is ~1e-4 here
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6 * scale)

    file = gguf.GGUFReader(path).tensors
    block_matrices = [t for t in file if t.tensor_type in DIRECT]
    float_matrices = [t for t in file if t.tensor_type == Q.F16]
    assert len(block_matrices) >= 7 and bool(float_matrices) == case.endswith("f16")
    # every row of every block matrix held once (a tied head shares the embedding's)
    assert held_bytes == sum(RATE[t.tensor_type] * int(t.n_elements) for t in block_matrices)
    assert held_bytes < sum(4 * int(t.n_elements) for t in block_matrices) / 3

    frozen = [n for n, m in model.named_modules() if isinstance(m, FrozenLinear)]
    plain = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    linears = [n for n, m in reference_model.named_modules() if isinstance(m, nn.Linear)]
    assert sorted(frozen + plain) == sorted(linears)
    assert len(plain) == len(float_matrices)  # F16 matrices stay float32 nn.Linear
    assert "lm_head" in frozen and isinstance(model.tok_emb, FrozenEmbedding)
    if CHECKPOINTS[case][1]:  # tied
        assert model.lm_head.held is model.tok_emb.held
    if case.startswith("gpt2"):
        assert isinstance(model.pos_emb, FrozenEmbedding)
    params = list(model.parameters())
    assert params and not any(p.requires_grad for p in params)
    assert not any(p.is_meta for p in params) and not any(b.is_meta for b in model.buffers())


def _embedding_grad(model: nn.Module, ids: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """∂(logits·g)/∂(the token embeddings), through every layer of ``model``."""
    embedded: list[torch.Tensor] = []

    def keep(_module, _inputs, out: torch.Tensor) -> torch.Tensor:
        out = out.detach().requires_grad_(True)
        embedded.append(out)
        return out

    handle = model.tok_emb.register_forward_hook(keep)
    try:
        logits = model(ids).logits
    finally:
        handle.remove()
    (grad,) = torch.autograd.grad((logits * g).sum(), embedded)
    return grad
