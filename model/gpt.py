"""Decoder-only GPT with a KV cache and full attention introspection.

Attention is written out as the seeds define it — softmax(QKᵀ/√d_k + mask)·V, heads
merged, output projection — and takes F.scaled_dot_product_attention as a fast path when
no intermediates are requested. The same forward serves training (whole sequences),
prefill and cached decode, with left padding expressed through ``attention_mask`` and
``position_ids`` exactly as the ONNX I/O contract expects, so this module is the
reference every exported graph is checked against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import GPTConfig

KVCache = list[tuple[Tensor, Tensor]]  # per layer: key, value each (B, nh, T_total, hs)


@dataclass
class AttentionIntermediates:
    """Everything seed 000 prints for one layer, for every head at once."""

    q: Tensor  # (B, nh, T, hs)
    k: Tensor  # (B, nh, T_past + T, hs)
    v: Tensor  # (B, nh, T_past + T, hs)
    scores: Tensor  # (B, nh, T, T_past + T)  raw QKᵀ
    scaled_scores: Tensor  # (B, nh, T, T_past + T)  QKᵀ/√d_k with -inf where masked
    weights: Tensor  # (B, nh, T, T_past + T)  α = softmax(scaled_scores)


@dataclass
class GPTOutput:
    logits: Tensor  # (B, T, vocab)
    present: KVCache  # keys/values including this call's tokens
    intermediates: list[AttentionIntermediates] | None = None
    loss: Tensor | None = None


def sinusoidal_table(max_len: int, d_model: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d))."""
    position = torch.arange(max_len, dtype=torch.float32).unsqueeze(1)  # (L, 1)
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32)
                         * (-math.log(10000.0) / d_model))  # (d/2,)
    table = torch.zeros(max_len, d_model)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq)
    return table  # (L, d)


def attention_allowed(
    attention_mask: Tensor, past_len: int, query_len: int
) -> Tensor:
    """Boolean (B, 1, T, T_past + T) mask: True where a query may attend to a key.

    A query at absolute position p sees keys at positions ≤ p that are not padding. A
    padding query (left padding) would then see nothing and softmax would give NaN, so
    every query may always see itself; those rows are discarded by the caller anyway.
    """
    total = past_len + query_len
    device = attention_mask.device
    query_pos = torch.arange(past_len, total, device=device).unsqueeze(1)  # (T, 1)
    key_pos = torch.arange(total, device=device).unsqueeze(0)  # (1, T_total)
    causal = key_pos <= query_pos  # (T, T_total)
    not_padding = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, T_total)
    diagonal = key_pos == query_pos  # (T, T_total)
    return (causal & not_padding) | diagonal  # (B, 1, T, T_total)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention; Q, K, V and output projections are bias-free (seed 000)
    unless ``attn_bias`` (GPT-2)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        d = config.d_model
        bias = config.attn_bias
        self.w_q = nn.Linear(d, d, bias=bias)
        self.w_k = nn.Linear(d, d, bias=bias)
        self.w_v = nn.Linear(d, d, bias=bias)
        self.w_o = nn.Linear(d, d, bias=bias)
        self.dropout = config.dropout
        self.use_sdpa = True  # see GPT.set_attention_impl

    def _split_heads(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)

    def forward(
        self,
        x: Tensor,  # (B, T, d)
        allowed: Tensor | None,  # (B, 1, T, T_past + T) or None for plain causal, no past
        past: tuple[Tensor, Tensor] | None,
        explicit: bool,
    ) -> tuple[Tensor, tuple[Tensor, Tensor], AttentionIntermediates | None]:
        b, t, d = x.shape
        q = self._split_heads(self.w_q(x))  # (B, nh, T, hs)
        k = self._split_heads(self.w_k(x))  # (B, nh, T, hs)
        v = self._split_heads(self.w_v(x))  # (B, nh, T, hs)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)  # (B, nh, T_past + T, hs)
            v = torch.cat([past[1], v], dim=2)  # (B, nh, T_past + T, hs)
        present = (k, v)

        inter: AttentionIntermediates | None = None
        dropout_p = self.dropout if self.training else 0.0
        if explicit or not self.use_sdpa:
            scores = q @ k.transpose(-2, -1)  # (B, nh, T, T_past + T)
            scaled = scores / math.sqrt(self.head_dim)
            if allowed is None:
                total = k.shape[2]
                allowed = torch.ones(t, total, dtype=torch.bool, device=x.device).tril(
                    diagonal=total - t)  # (T, T_total)
            scaled = scaled.masked_fill(~allowed, float("-inf"))
            weights = F.softmax(scaled, dim=-1)  # (B, nh, T, T_past + T)
            out = F.dropout(weights, dropout_p, self.training) @ v  # (B, nh, T, hs)
            if explicit:
                inter = AttentionIntermediates(q, k, v, scores, scaled, weights)
        elif allowed is None and past is None:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        else:
            if allowed is None:
                total = k.shape[2]
                allowed = torch.ones(t, total, dtype=torch.bool, device=x.device).tril(
                    diagonal=total - t)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p)
        out = out.transpose(1, 2).contiguous().view(b, t, d)  # (B, T, d): heads merged
        return self.w_o(out), present, inter


class FeedForward(nn.Module):
    """Position-wise d → d_ff → d with ReLU (the seeds' choice), exact GELU, or GPT-2's
    tanh-approximated GELU (``gelu_new`` in transformers)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.d_model, config.d_ff)
        self.down = nn.Linear(config.d_ff, config.d_model)
        self.act: nn.Module = (nn.ReLU() if config.activation == "relu"
                               else nn.GELU(approximate="tanh" if config.activation == "gelu_tanh"
                                            else "none"))
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.down(self.act(self.up(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + Attn(LN(x)), then x + FFN(LN(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.ffn = FeedForward(config)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self, x: Tensor, allowed: Tensor | None, past: tuple[Tensor, Tensor] | None,
        explicit: bool,
    ) -> tuple[Tensor, tuple[Tensor, Tensor], AttentionIntermediates | None]:
        attn_out, present, inter = self.attn(self.ln_1(x), allowed, past, explicit)
        x = x + self.resid_dropout(attn_out)
        x = x + self.ffn(self.ln_2(x))
        return x, present, inter


class GPT(nn.Module):
    """Token + position embeddings, N pre-norm blocks, final LayerNorm, LM head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb: nn.Embedding | None = None
        if config.position == "learned":
            self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model)
        else:
            self.register_buffer(
                "pos_table", sinusoidal_table(config.max_seq_len, config.d_model),
                persistent=False)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layers)])
        self.ln_f = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        if config.tie_weights:
            self.lm_head.weight = self.tok_emb.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """N(0, 0.02) for weights and embeddings, zero biases, identity LayerNorms (seed 002)."""
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def set_attention_impl(self, impl: Literal["sdpa", "matmul"]) -> None:
        """Choose how attention runs when no intermediates are requested.

        ``sdpa`` (default) is PyTorch's fused kernel, fastest for training and eager use.
        ``matmul`` writes softmax(QKᵀ/√d_k + mask)·V out; the exporter traces it because
        ONNX Runtime fuses MatMul(Q, Transpose(K)) into one FusedMatMul that reads the key
        cache in place, whereas the traced SDPA decomposition transposes and scales the
        whole key cache at every decode step. Both agree to 1e-6.
        """
        if impl not in ("sdpa", "matmul"):
            raise ValueError(f"unknown attention impl {impl!r}; 'sdpa' or 'matmul'")
        for block in self.blocks:
            block.attn.use_sdpa = impl == "sdpa"  # type: ignore[union-attr]

    def num_params(self) -> int:
        """Trainable parameters, counting a tied embedding/head matrix once."""
        return sum(p.numel() for p in self.parameters())

    def positions(self, position_ids: Tensor) -> Tensor:
        if self.pos_emb is not None:
            return self.pos_emb(position_ids)  # (B, T, d)
        table: Tensor = self.pos_table  # type: ignore[assignment]
        return table[position_ids]  # (B, T, d)

    def forward(
        self,
        input_ids: Tensor,  # (B, T) int64
        attention_mask: Tensor | None = None,  # (B, T_past + T): 1 = real token, 0 = padding
        position_ids: Tensor | None = None,  # (B, T)
        past_key_values: KVCache | None = None,
        targets: Tensor | None = None,  # (B, T), -100 ignored
        return_intermediates: bool = False,
    ) -> GPTOutput:
        b, t = input_ids.shape
        past_len = past_key_values[0][0].shape[2] if past_key_values else 0
        if past_len + t > self.config.max_seq_len:
            raise ValueError(
                f"sequence of {past_len + t} tokens exceeds max_seq_len {self.config.max_seq_len}")
        if position_ids is None:
            if attention_mask is not None:
                # Left padding: a row's first real token is position 0.
                position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, past_len:]
            else:
                position_ids = torch.arange(past_len, past_len + t, device=input_ids.device)
                position_ids = position_ids.unsqueeze(0).expand(b, t)
        allowed = None
        if attention_mask is not None:
            allowed = attention_allowed(attention_mask, past_len, t)  # (B, 1, T, T_total)

        x = self.drop(self.tok_emb(input_ids) + self.positions(position_ids))  # (B, T, d)
        present: KVCache = []
        intermediates: list[AttentionIntermediates] = []
        for i, block in enumerate(self.blocks):
            past = past_key_values[i] if past_key_values else None
            x, layer_present, inter = block(x, allowed, past, return_intermediates)
            present.append(layer_present)
            if inter is not None:
                intermediates.append(inter)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)

        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)
        return GPTOutput(
            logits=logits,
            present=present,
            intermediates=intermediates if return_intermediates else None,
            loss=loss,
        )
