"""Rotary position embeddings (RoPE), computed exactly as transformers' Llama and Qwen2 do.

A query or key at position p is rotated pairwise, (x_i, x_{i+hs/2}) by the angle
p·θ_i with θ_i = rope_theta^(-2i/hs): the "rotate half" layout of transformers (not the
interleaved one of the original paper), so imported weights need no permutation. The
scalings below only change θ, and LongRoPE (Phi-3.5, Phi-3-128k) also scales cos and sin
by its attention factor; LongRoPE's θ changes once a sequence passes the pretrained length,
so a LongRoPE model is served with the short factors up to that length only (its
``max_seq_len`` capped there at import, model/architectures/llama.py). Anything else
(dynamic NTK, YaRN ...) depends on the sequence length throughout, and is refused.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings")
LONGROPE_KEYS = ("short_factor", "long_factor", "attention_factor")


def rope_kind(scaling: dict[str, Any]) -> str:
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def check_rope_scaling(scaling: dict[str, Any]) -> None:
    """Raise ValueError unless ``scaling`` is one this module computes exactly."""
    kind = rope_kind(scaling)
    if kind == "default":
        return
    if kind == "linear":
        if not float(scaling.get("factor", 0)) > 0:
            raise ValueError(f"rope_scaling {scaling}: linear scaling needs a factor > 0")
        return
    if kind == "llama3":
        missing = [k for k in LLAMA3_KEYS if k not in scaling]
        if missing:
            raise ValueError(f"rope_scaling {scaling}: llama3 scaling needs {missing}")
        if float(scaling["high_freq_factor"]) == float(scaling["low_freq_factor"]):
            raise ValueError(f"rope_scaling {scaling}: high_freq_factor must differ from "
                             "low_freq_factor")
        return
    if kind == "longrope":
        missing = [k for k in LONGROPE_KEYS if scaling.get(k) is None]
        if missing:
            raise ValueError(f"rope_scaling {scaling}: longrope scaling needs {missing}")
        return
    raise ValueError(f"rope_scaling type {kind!r} is not supported (only default, linear, "
                     "llama3 and longrope)")


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by (LongRoPE's attention factor; 1 otherwise)."""
    if scaling is None or rope_kind(scaling) != "longrope":
        return 1.0
    return float(scaling["attention_factor"])


def inverse_frequencies(head_dim: int, theta: float,
                        scaling: dict[str, Any] | None = None) -> Tensor:
    """θ_i for i < head_dim/2, (hs/2,) float32, with transformers' arithmetic."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)  # (hs/2,)
    if scaling is None or rope_kind(scaling) == "default":
        return inv_freq
    check_rope_scaling(scaling)
    if rope_kind(scaling) == "longrope":  # the short factors: up to the pretrained length
        short = torch.tensor(scaling["short_factor"], dtype=torch.float32)  # (hs/2,)
        return 1.0 / (short * theta ** exponents)
    factor = float(scaling["factor"])
    if rope_kind(scaling) == "linear":
        return inv_freq / factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class Rotary(nn.Module):
    """position_ids → (cos, sin), each (B, T, hs), shared by every layer."""

    def __init__(self, head_dim: int, theta: float,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, theta, scaling),
                             persistent=False)
        self.scale = attention_factor(scaling)

    def forward(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        inv_freq: Tensor = self.inv_freq  # type: ignore[assignment]
        freqs = position_ids[..., None].float() * inv_freq  # (B, T, hs/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, hs)
        if self.scale != 1.0:
            return emb.cos() * self.scale, emb.sin() * self.scale
        return emb.cos(), emb.sin()


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (B, heads, T, hs) by the angles of its positions; cos/sin (B, T, rd): the
    first rd dimensions turn, the rest pass (partial rotary, Phi-4-mini)."""
    rd = cos.shape[-1]
    if rd < x.shape[-1]:
        turned, kept = x[..., :rd], x[..., rd:]  # (B, heads, T, rd), (B, heads, T, hs − rd)
        return torch.cat((apply_rotary(turned, cos, sin), kept), dim=-1)
    return x * cos[:, None] + rotate_half(x) * sin[:, None]  # (B, heads, T, hs)
