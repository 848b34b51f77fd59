"""A GGUF checkpoint's frozen base: its quantised blocks, dequantised layer by layer.

QLoRA's idea on llama.cpp's formats: the weights a fine-tune does not train stay in the
form the checkpoint holds them (4-bit codes and their block scales, model/gguf/codes.py),
and each layer's float32 weight exists only while that layer computes: built in the
forward, dropped, built again for the backward. A fine-tune of a GGUF model then needs
about the file's size for its base, not four bytes a weight (the 1B Llama shape's Q4_K_M
file of 638 MiB: 884 MiB held instead of 4.3 GB of float32).

The value of every weight is exactly what ``gguf.quants.dequantize`` gives (the same
float32 operations as model/gguf/codes.py's ``Blocks.dequantize``), so the frozen model
computes what a checkpoint loaded in float32 computes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from model.checkpoint import GGUF_WEIGHTS_FILE
from model.gguf.codes import DIRECT, Blocks, read_blocks
from model.gguf.reader import HeldWeights


class HeldBlocks(nn.Module):
    """A (N, K) weight as GGUF blocks: uint8 codes (4-bit ones two to a byte), a float32
    scale per block and a minimum or a zero point; no float32 copy of the weight."""

    codes: Tensor  # (N, K/block, block or block/2) uint8
    scales: Tensor  # (N, K/block) float32
    mins: Tensor | None  # (N, K/block) float32

    def __init__(self, blocks: Blocks) -> None:
        super().__init__()
        n, nb, size = blocks.codes.shape
        self.shape = (n, nb * size)
        self.zero = blocks.zero
        self.packed = blocks.bits == 4  # codes < 16: element j and j + size/2 share a byte
        codes = blocks.codes
        if self.packed:
            codes = codes[..., :size // 2] | (codes[..., size // 2:] << np.uint8(4))
        self.register_buffer("codes", torch.from_numpy(np.ascontiguousarray(codes)),
                             persistent=False)  # (N, K/block, block or block/2) uint8
        self.register_buffer("scales", torch.from_numpy(np.ascontiguousarray(blocks.scales)),
                             persistent=False)  # (N, K/block) float32
        mins = None if blocks.mins is None else torch.from_numpy(
            np.ascontiguousarray(blocks.mins))
        self.register_buffer("mins", mins, persistent=False)  # (N, K/block) float32 or None

    def _codes(self, rows: Tensor | None) -> Tensor:
        codes = self.codes if rows is None else self.codes[rows]
        if self.packed:
            codes = torch.cat([codes & 15, codes >> 4], dim=-1)  # (.., K/block, block)
        return codes

    def dequantize(self, rows: Tensor | None = None) -> Tensor:
        """The float32 weight (N, K), or those rows of it ((*rows.shape, K)), as gguf
        computes it: scale·q + min, or scale·(q − zero)."""
        w = self._codes(rows).float()  # (.., K/block, block)
        scales = self.scales if rows is None else self.scales[rows]
        if self.mins is not None:
            mins = self.mins if rows is None else self.mins[rows]
            w.mul_(scales[..., None]).add_(mins[..., None])
        else:
            w.sub_(float(self.zero)).mul_(scales[..., None])
        return w.flatten(-2)  # (.., K)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins)
                   if t is not None)


class _DequantizedMatmul(torch.autograd.Function):
    """x·Wᵀ with W dequantised for the product and again for the input's gradient, so
    autograd never keeps a layer's float32 weight between the forward and the backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, held: HeldBlocks) -> Tensor:
        ctx.held = held
        return x @ held.dequantize().to(x.dtype).T  # (.., N)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad @ ctx.held.dequantize().to(grad.dtype), None  # (.., K)


class FrozenLinear(nn.Module):
    """An nn.Linear whose weight is held as GGUF blocks and never trained."""

    bias: Tensor | None

    def __init__(self, held: HeldBlocks, bias: Tensor | None) -> None:
        super().__init__()
        self.held = held
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)
        self.out_features, self.in_features = held.shape

    def forward(self, x: Tensor) -> Tensor:  # (.., K) → (.., N)
        y: Tensor = _DequantizedMatmul.apply(x, self.held)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class FrozenEmbedding(nn.Module):
    """Token embeddings held as blocks: only the looked-up rows are dequantised."""

    def __init__(self, held: HeldBlocks) -> None:
        super().__init__()
        self.held = held
        self.num_embeddings, self.embedding_dim = held.shape

    def forward(self, ids: Tensor) -> Tensor:  # (B, T) → (B, T, d)
        return self.held.dequantize(ids)


def frozen_gguf_model(ckpt_dir: Path, config: Any) -> tuple[Any, int]:
    """The checkpoint's model.gpt.GPT with every matrix of a block type (``DIRECT``) held
    as blocks (FrozenLinear / FrozenEmbedding), the rest (norms, float matrices) as frozen
    float32 parameters; and the bytes the held blocks take.

    The file is read once and its memory map let go: what stays resident is the blocks.
    Matrices of float types (F16, F32) are held as float32, as the checkpoint loads them."""
    held = HeldWeights(ckpt_dir / GGUF_WEIGHTS_FILE, config)
    kept = frozenset(DIRECT)
    model = held.model(leave=kept)  # DIRECT matrices on the meta device, the rest filled
    rows = {t.name: int(t.shape[-1]) if len(t.shape) > 1 else 1 for t in held.reader.tensors}
    types = {t.name: t.tensor_type for t in held.reader.tensors}
    tensors = {t.name: t for t in held.reader.tensors}
    sources = held.arch.gguf_sources(held.family, config, rows)
    by_tensor: dict[str, Blocks] = {}
    made: dict[tuple[str, bytes], HeldBlocks] = {}
    nbytes = 0
    for name, source in sources.items():
        if types[source.tensor] not in kept:
            continue
        if source.tensor not in by_tensor:
            by_tensor[source.tensor] = read_blocks(tensors[source.tensor])
        key = (source.tensor, source.rows.tobytes())
        if key not in made:  # a tied head shares the embedding's blocks
            made[key] = HeldBlocks(by_tensor[source.tensor].take(source.rows))
            nbytes += made[key].nbytes()
        _replace(model, name, made[key])
    tensors.clear()
    by_tensor.clear()
    held.close()
    model.requires_grad_(False)
    return model, nbytes


def _replace(model: nn.Module, param: str, blocks: HeldBlocks) -> None:
    """Put ``blocks`` where ``param`` (e.g. blocks.0.attn.w_q.weight) was."""
    module_name, _, attr = param.rpartition(".")
    if attr != "weight":
        raise ValueError(f"{param}: only weights are held as blocks")
    module = model.get_submodule(module_name)
    parent_name, _, child = module_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if isinstance(module, nn.Embedding):
        setattr(parent, child, FrozenEmbedding(blocks))
    elif isinstance(module, nn.Linear):
        setattr(parent, child, FrozenLinear(blocks, module.bias))
    else:
        raise ValueError(f"{param}: a {type(module).__name__} cannot hold GGUF blocks")
