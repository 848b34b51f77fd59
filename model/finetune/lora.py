"""LoRA: a trainable low-rank update beside each adapted projection of a frozen model.

y = W·x + s·B·A·dropout(x), A (r, in) and B (out, r), s = alpha / r (rsLoRA: alpha / √r),
B starting at zero so that training starts from the base model exactly (PEFT's
initialisation: A Kaiming-uniform, B zeros). One :class:`LoRA` per module an adapter
names (:class:`model.architectures.base.LoRATarget`, transformers' names, so the adapter
is PEFT's); where transformers fuses projections that we keep apart (Phi-3's qkv_proj,
GPT-2's c_attn) our layers share A and each adds its own rows of B.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.architectures import architecture
from model.architectures.base import LoRATarget, ModelConfig


@dataclass(frozen=True)
class LoRASettings:
    """PEFT's LoraConfig fields a training run sets (defaults: the common fine-tune ones,
    not PEFT's r 8 / alpha 8 / dropout 0)."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    rslora: bool = False  # scale alpha / √r: the update's size no longer shrinks with r
    targets: tuple[str, ...] = ()  # PEFT target_modules kinds (q_proj ...); () = all

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


class _SharedDropout:
    """One dropout mask for every projection that reads the same input tensor (Q, K and V;
    gate and up), drawn once: as transformers' fused modules have one (Phi-3's qkv_proj),
    and because on a CPU drawing a mask costs more than the low-rank product it feeds. The
    input is recognised by identity (a weak reference), so a recomputation under gradient
    checkpointing, which replays the RNG, draws the same masks again; a layer reading the
    same tensor twice gets a new mask the second time."""

    def __init__(self) -> None:
        # the input, p, the dropped input, and the layers that have used it
        self._last: tuple[weakref.ref[Tensor], float, Tensor, set[int]] | None = None

    def __call__(self, x: Tensor, p: float, reader: object) -> Tensor:
        """``x`` dropped with probability ``p``: the mask drawn for ``x`` last, unless
        ``reader`` (an adapted layer) has used that one already (then a new one)."""
        last = self._last
        if last is not None and last[0]() is x and last[1] == p and id(reader) not in last[3]:
            last[3].add(id(reader))
            return last[2]
        dropped = F.dropout(x, p, training=True)
        self._last = (weakref.ref(x), p, dropped, {id(reader)})
        return dropped


_dropout = _SharedDropout()


class LoRA(nn.Module):
    """A and B of one adapted module (transformers' name ``target.module``)."""

    def __init__(self, target: LoRATarget, in_features: int, out_features: int, rank: int,
                 scale: float, dropout: float, generator: torch.Generator | None = None
                 ) -> None:
        super().__init__()
        self.target = target
        self.scale = scale
        self.dropout = dropout
        self.lora_A = nn.Parameter(torch.empty(rank, in_features))  # (r, in)
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank))  # (out, r)
        # nn.Linear's initialisation, as PEFT's
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5), generator=generator)

    def update(self, x: Tensor, rows: slice) -> Tensor:
        """s·B[rows]·A·x: (.., in) → (.., len(rows)), for x already dropped out."""
        low = F.linear(x, self.lora_A.to(x.dtype))  # (.., r)
        return F.linear(low, self.lora_B[rows].to(x.dtype)) * self.scale  # (.., rows)

    def delta(self) -> Tensor:
        """s·B·A, the (out, in) change a merge adds to the weight."""
        return (self.lora_B.float() @ self.lora_A.float()) * self.scale


class AdaptedLinear(nn.Module):
    """A frozen projection of ours plus its rows of a :class:`LoRA` update."""

    def __init__(self, base: nn.Module, lora: LoRA, rows: slice) -> None:
        super().__init__()
        self.base = base
        self.rows = rows
        # a plain reference: the LoRA's parameters belong to the Adapter (several layers
        # may share one), not to each layer that reads them; so `.to()` and the optimizer
        # reach them through the Adapter (TunedModel registers it)
        self._lora = (lora,)

    def forward(self, x: Tensor) -> Tensor:  # (.., in) → (.., out)
        y: Tensor = self.base(x)
        lora = self._lora[0]
        if self.training and lora.dropout > 0:  # its own mode: model.eval() turns it off
            x = _dropout(x, lora.dropout, self)
        return y + lora.update(x, self.rows)


class Adapter(nn.Module):
    """Every LoRA of one fine-tune, in target order: what is trained and saved."""

    def __init__(self, loras: Iterable[LoRA], settings: LoRASettings) -> None:
        super().__init__()
        self.loras = nn.ModuleList(loras)
        self.settings = settings

    def each(self) -> list[LoRA]:
        return [lora for lora in self.loras if isinstance(lora, LoRA)]


def targets_of(config: ModelConfig, kinds: tuple[str, ...] = ()) -> list[LoRATarget]:
    """The family's LoRA targets of these kinds (all when empty); an unknown kind is
    refused naming the family's."""
    every = architecture(config.arch).lora_targets(config)
    known = list(dict.fromkeys(t.kind for t in every))
    unknown = [k for k in kinds if k not in known]
    if unknown:
        raise ValueError(f"LoRA target module(s) {unknown} are not in this "
                         f"{config.arch} model; it has {known}")
    return [t for t in every if not kinds or t.kind in kinds]


def attach(model: nn.Module, settings: LoRASettings, seed: int) -> Adapter:
    """Put a fresh LoRA beside every targeted projection of ``model`` (in place) and
    return them; A's initialisation is a function of ``seed`` alone (no global RNG used)."""
    generator = torch.Generator().manual_seed(seed)
    config: ModelConfig = model.config  # type: ignore[assignment]
    loras = [_lora_for(model, t, settings, generator)
             for t in targets_of(config, settings.targets)]
    adapter = Adapter(loras, settings)
    wire(model, adapter)
    return adapter


def _lora_for(model: nn.Module, target: LoRATarget, settings: LoRASettings,
              generator: torch.Generator) -> LoRA:
    layers: list[Any] = [model.get_submodule(name) for name in target.ours]
    in_features = {int(layer.in_features) for layer in layers}
    if len(in_features) != 1:
        raise ValueError(f"{target.module}: its parts {target.ours} read inputs of "
                         f"different widths {sorted(in_features)}")
    out_features = sum(int(layer.out_features) for layer in layers)
    return LoRA(target, in_features.pop(), out_features, settings.rank, settings.scale,
                settings.dropout, generator)


def wire(model: nn.Module, adapter: Adapter) -> None:
    """Replace each targeted projection by an :class:`AdaptedLinear` over it."""
    for lora in adapter.each():
        start = 0
        for name in lora.target.ours:
            layer: Any = model.get_submodule(name)
            if isinstance(layer, AdaptedLinear):
                raise ValueError(f"{name} is adapted already")
            rows = slice(start, start + int(layer.out_features))
            start = rows.stop
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, AdaptedLinear(layer, lora, rows))
        if start != lora.lora_B.shape[0]:
            raise ValueError(f"{lora.target.module}: B has {lora.lora_B.shape[0]} rows, its "
                             f"layers {start}")


def merged_weights(model: nn.Module, adapter: Adapter) -> dict[str, Tensor]:
    """Each adapted layer's weight with its rows of s·B·A added, float32, by our
    parameter name (``blocks.0.attn.w_q.weight``): the weights a merged checkpoint holds.
    ``model`` is the float32 base the adapter was not wired into."""
    out: dict[str, Tensor] = {}
    for lora in adapter.each():
        delta = lora.delta()  # (out, in)
        start = 0
        for name in lora.target.ours:
            weight = model.get_parameter(f"{name}.weight")
            rows = weight.shape[0]
            out[f"{name}.weight"] = weight.detach().float() + delta[start:start + rows]
            start += rows
    return out
