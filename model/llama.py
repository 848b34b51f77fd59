"""The Llama-family blocks (SmolLM2, Qwen2.5, TinyLlama): RMSNorm, SwiGLU and the block.

Attention (grouped-query, rotary) is model.gpt.CausalSelfAttention with ``n_kv_heads``
and rotary angles; these are the pieces that differ from GPT. Each computes exactly what
transformers' LlamaRMSNorm / LlamaMLP / LlamaDecoderLayer compute in float32, so
imported weights give the same logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import GPTConfig


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · w: no centring, no bias (cheaper than LayerNorm)."""

    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:  # (B, T, d)
        variance = x.pow(2).mean(-1, keepdim=True)  # (B, T, 1)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) ⊙ up(x)): a gated feed-forward layer, d → d_ff → d."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d, f, bias = config.d_model, config.d_ff, config.mlp_bias
        self.gate = nn.Linear(d, f, bias=bias)
        self.up = nn.Linear(d, f, bias=bias)
        self.down = nn.Linear(f, d, bias=bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.down(F.silu(self.gate(x)) * self.up(x)))  # (B, T, d)


class LlamaBlock(nn.Module):
    """Pre-norm block with RMSNorm: x + Attn(norm(x)), then x + SwiGLU(norm(x))."""

    def __init__(self, config: GPTConfig, attn: nn.Module) -> None:
        super().__init__()
        self.ln_1 = RMSNorm(config.d_model, config.layer_norm_eps)
        self.attn = attn  # model.gpt.CausalSelfAttention, grouped and rotary
        self.ln_2 = RMSNorm(config.d_model, config.layer_norm_eps)
        self.ffn = SwiGLU(config)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self, x: Tensor, allowed: Tensor | None, past: tuple[Tensor, Tensor] | None,
        explicit: bool, rotary: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, tuple[Tensor, Tensor], Any]:  # Any: AttentionIntermediates | None
        attn_out, present, inter = self.attn(self.ln_1(x), allowed, past, explicit, rotary)
        x = x + self.resid_dropout(attn_out)
        x = x + self.ffn(self.ln_2(x))
        return x, present, inter
