"""Causal self-attention, written out as the seeds define it, and its boolean mask.

softmax(QKᵀ/√d_k + mask)·V, heads merged, output projection; F.scaled_dot_product_attention
is the fast path when no intermediates are requested. Shared by every architecture: the
families differ around it (norms, MLP, positions), not in it. Grouped-query attention
(fewer key/value heads) and rotary angles are switches of the config, not separate code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.architectures.base import ModelConfig
from model.rotary import apply_rotary


@dataclass
class AttentionIntermediates:
    """Everything seed 000 prints for one layer, for every head at once."""

    q: Tensor  # (B, nh, T, hs)
    k: Tensor  # (B, nh, T_past + T, hs)  per query head (GQA: its group's key head)
    v: Tensor  # (B, nh, T_past + T, hs)
    scores: Tensor  # (B, nh, T, T_past + T)  raw QKᵀ
    scaled_scores: Tensor  # (B, nh, T, T_past + T)  QKᵀ/√d_k with -inf where masked
    weights: Tensor  # (B, nh, T, T_past + T)  α = softmax(scaled_scores)


def attention_allowed(
    attention_mask: Tensor, past_len: int, query_len: int, window: int | None = None
) -> Tensor:
    """Boolean (B, 1, T, T_past + T) mask: True where a query may attend to a key.

    A query at absolute position p sees keys at positions ≤ p that are not padding, and
    with a sliding ``window`` only those at positions > p − window (the last ``window``,
    itself included; padding sits left of every real token, so column distance is
    position distance). A padding query (left padding) would then see nothing and softmax
    would give NaN, so every query may always see itself; those rows are discarded by the
    caller anyway.
    """
    total = past_len + query_len
    device = attention_mask.device
    query_pos = torch.arange(past_len, total, device=device).unsqueeze(1)  # (T, 1)
    key_pos = torch.arange(total, device=device).unsqueeze(0)  # (1, T_total)
    causal = key_pos <= query_pos  # (T, T_total)
    if window is not None:
        causal = causal & (query_pos - key_pos < window)
    not_padding = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, T_total)
    diagonal = key_pos == query_pos  # (T, T_total)
    return (causal & not_padding) | diagonal  # (B, 1, T, T_total)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention; Q, K, V and output projections are bias-free (seed 000)
    unless ``attn_bias`` (GPT-2; Q/K/V only with ``qkv_bias``, Qwen2).

    With ``n_kv_heads`` < ``n_heads`` (grouped-query attention, Llama family) the keys and
    values have fewer heads: query head h reads key/value head h // (n_heads / n_kv_heads),
    and only those heads are cached. Rotary angles, when given, rotate Q and K before the
    keys enter the cache; with ``qk_norm`` (Qwen3) each head's query and key are
    RMS-normalised first. Heads may be wider than d_model / n_heads (``head_size``).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.kv_heads
        self.head_dim = config.head_dim
        d, kv, width = config.d_model, config.kv_heads * config.head_dim, config.attention_width
        bias = config.attn_bias
        self.w_q = nn.Linear(d, width, bias=bias or config.qkv_bias)
        self.w_k = nn.Linear(d, kv, bias=bias or config.qkv_bias)
        self.w_v = nn.Linear(d, kv, bias=bias or config.qkv_bias)
        self.w_o = nn.Linear(width, d, bias=bias)
        # per-head norms of the query and key before rotary (Qwen3): the architecture's
        # RMSNorm over head_dim, set by its block factory
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        self.dropout = config.dropout
        self.use_sdpa = True  # see GPT.set_attention_impl
        self.scale = config.attn_scale  # None: 1/√head_dim

    def _split_heads(self, x: Tensor, heads: int) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, heads, self.head_dim).transpose(1, 2)  # (B, heads, T, hs)

    def forward(
        self,
        x: Tensor,  # (B, T, d)
        allowed: Tensor | None,  # (B, 1, T, T_past + T) or None for plain causal, no past
        past: tuple[Tensor, Tensor] | None,
        explicit: bool,
        rotary: tuple[Tensor, Tensor] | None = None,  # cos, sin (B, T, hs)
    ) -> tuple[Tensor, tuple[Tensor, Tensor], AttentionIntermediates | None]:
        b, t, _ = x.shape
        nh, nkv = self.n_heads, self.n_kv_heads
        q = self._split_heads(self.w_q(x), nh)  # (B, nh, T, hs)
        k = self._split_heads(self.w_k(x), nkv)  # (B, nkv, T, hs)
        v = self._split_heads(self.w_v(x), nkv)  # (B, nkv, T, hs)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # over hs, per head and position
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)  # (B, nkv, T_past + T, hs)
            v = torch.cat([past[1], v], dim=2)  # (B, nkv, T_past + T, hs)
        present = (k, v)
        total = k.shape[2]

        inter: AttentionIntermediates | None = None
        dropout_p = self.dropout if self.training else 0.0
        if explicit or not self.use_sdpa:
            # Grouped: the n_rep query heads of a group share one key/value head, so fold
            # them into the query axis and multiply against the cache as it is (no copy).
            rep = nh // nkv
            qg = q.reshape(b, nkv, rep * t, self.head_dim)  # (B, nkv, rep·T, hs)
            scores = (qg @ k.transpose(-2, -1)).view(b, nh, t, total)  # (B, nh, T, T_total)
            scaled = (scores / math.sqrt(self.head_dim) if self.scale is None
                      else scores * self.scale)
            if allowed is None:
                allowed = torch.ones(t, total, dtype=torch.bool, device=x.device).tril(
                    diagonal=total - t)  # (T, T_total)
            scaled = scaled.masked_fill(~allowed, float("-inf"))
            weights = F.softmax(scaled, dim=-1)  # (B, nh, T, T_past + T)
            dropped = F.dropout(weights, dropout_p, self.training)
            out = (dropped.view(b, nkv, rep * t, total) @ v).view(b, nh, t, self.head_dim)
            if explicit:
                # Recorded per query head: each sees its group's keys and values.
                k_q, v_q = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
                inter = AttentionIntermediates(q, k_q, v_q, scores, scaled, weights)
        elif allowed is None and past is None:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                                 scale=self.scale,
                                                 enable_gqa=nkv != nh)
        else:
            if allowed is None:
                allowed = torch.ones(t, total, dtype=torch.bool, device=x.device).tril(
                    diagonal=total - t)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p,
                                                 scale=self.scale,
                                                 enable_gqa=nkv != nh)
        out = out.transpose(1, 2).contiguous().view(b, t, nh * self.head_dim)  # (B, T, nh·hs)
        return self.w_o(out), present, inter
