"""The residual stream after each block, read and steered: forward hooks on the blocks.

The PyTorch reference for control vectors (llama.cpp's, service/contract/control_vector.py):
:func:`steered` adds a direction to the residual stream exactly where llama.cpp adds it
(src/llama-adapter.cpp ``llama_adapter_cvec`` over ``build_cvec`` in every model graph):

- direction ``k`` is added to the output of block ``k``, blocks counted from 0, so the
  first block's output is never steered and ``k`` runs 1 … n_layers − 1;
- ``--control-vector-scaled FILE SCALE`` multiplies the directions by the scale as the
  file is read, in float32, and the product is added;
- ``--control-vector-layer-range START END`` (inclusive; llama.cpp's defaults 1 and
  n_layers) steers only the layers inside it.

The next block reads the steered stream, so every later layer (and the KV cache it writes)
sees the vector, as in llama.cpp. :func:`block_outputs` reads the same points unsteered:
what ``llama-cvector-generator`` collects (its ``l_out`` tensors).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn


def steering_layers(directions: Mapping[int, Any], n_layers: int,
                    layers: tuple[int, int] | None = None) -> list[int]:
    """The layers llama.cpp steers: those with a direction, inside ``layers`` (inclusive),
    and 1 … n_layers − 1; a direction outside 1 … n_layers − 1 is refused."""
    outside = sorted(k for k in directions if not 1 <= k < n_layers)
    if outside:
        raise ValueError(f"directions for layers {outside}: a model of {n_layers} layers is "
                         f"steered at layers 1 … {n_layers - 1}")
    start, end = layers if layers is not None else (1, n_layers)
    return sorted(k for k in directions if start <= k <= end)


@contextmanager
def steered(model: nn.Module, directions: Mapping[int, Tensor | np.ndarray],
            scale: float = 1.0, layers: tuple[int, int] | None = None) -> Iterator[nn.Module]:
    """Within the block, ``model`` (a model.gpt.GPT) adds ``scale`` × direction ``k`` to
    the output (B, T, d) of block ``k`` at every position, for the layers
    :func:`steering_layers` picks."""
    blocks: nn.ModuleList = model.blocks  # type: ignore[assignment]
    handles = []
    try:
        for k in steering_layers(directions, len(blocks), layers):
            # llama.cpp scales in float32 when it loads the file, then adds the product
            added = torch.as_tensor(np.asarray(directions[k], dtype=np.float32)) * \
                torch.tensor(scale, dtype=torch.float32)  # (d,)
            handles.append(blocks[k].register_forward_hook(_adder(added)))
        yield model
    finally:
        for handle in handles:
            handle.remove()


def _adder(added: Tensor) -> Any:
    def hook(module: nn.Module, args: Any, output: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        x = output[0]  # (B, T, d): the residual stream after the block
        return (x + added.to(x.device, x.dtype), *output[1:])

    return hook


def block_outputs(model: nn.Module, input_ids: Tensor) -> list[Tensor]:
    """The residual stream after every block, (B, T, d) each, for ``input_ids`` (B, T):
    one forward pass, read through hooks (with any :func:`steered` vector included)."""
    blocks: nn.ModuleList = model.blocks  # type: ignore[assignment]
    seen: list[Tensor] = []

    def keep(module: nn.Module, args: Any, output: tuple[Tensor, ...]) -> None:
        seen.append(output[0].detach())

    handles = [block.register_forward_hook(keep) for block in blocks]
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for handle in handles:
            handle.remove()
    return seen
