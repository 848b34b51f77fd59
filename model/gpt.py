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
from model.llama import LlamaBlock, RMSNorm
from model.rotary import Rotary, apply_rotary

KVCache = list[tuple[Tensor, Tensor]]  # per layer: key, value each (B, nkv, T_total, hs)


@dataclass
class AttentionIntermediates:
    """Everything seed 000 prints for one layer, for every head at once."""

    q: Tensor  # (B, nh, T, hs)
    k: Tensor  # (B, nh, T_past + T, hs)  per query head (GQA: its group's key head)
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
    unless ``attn_bias`` (GPT-2; Q/K/V only with ``qkv_bias``, Qwen2).

    With ``n_kv_heads`` < ``n_heads`` (grouped-query attention, Llama family) the keys and
    values have fewer heads: query head h reads key/value head h // (n_heads / n_kv_heads),
    and only those heads are cached. Rotary angles, when given, rotate Q and K before the
    keys enter the cache.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.kv_heads
        self.head_dim = config.head_dim
        d, kv = config.d_model, config.kv_heads * config.head_dim
        bias = config.attn_bias
        self.w_q = nn.Linear(d, d, bias=bias or config.qkv_bias)
        self.w_k = nn.Linear(d, kv, bias=bias or config.qkv_bias)
        self.w_v = nn.Linear(d, kv, bias=bias or config.qkv_bias)
        self.w_o = nn.Linear(d, d, bias=bias)
        self.dropout = config.dropout
        self.use_sdpa = True  # see GPT.set_attention_impl

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
        b, t, d = x.shape
        nh, nkv = self.n_heads, self.n_kv_heads
        q = self._split_heads(self.w_q(x), nh)  # (B, nh, T, hs)
        k = self._split_heads(self.w_k(x), nkv)  # (B, nkv, T, hs)
        v = self._split_heads(self.w_v(x), nkv)  # (B, nkv, T, hs)
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
            scaled = scores / math.sqrt(self.head_dim)
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
                                                 enable_gqa=nkv != nh)
        else:
            if allowed is None:
                allowed = torch.ones(t, total, dtype=torch.bool, device=x.device).tril(
                    diagonal=total - t)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p,
                                                 enable_gqa=nkv != nh)
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
    """Token + position embeddings, N pre-norm blocks, final LayerNorm, LM head.

    ``arch="llama"``: no position embeddings (rotary angles rotate Q and K in every
    layer), RMSNorm, SwiGLU and grouped-query attention (model/llama.py).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb: nn.Embedding | None = None
        self.rotary: Rotary | None = None
        if config.position == "learned":
            self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model)
        elif config.position == "rope":
            self.rotary = Rotary(config.head_dim, config.rope_theta, config.rope_scaling)
        else:
            self.register_buffer(
                "pos_table", sinusoidal_table(config.max_seq_len, config.d_model),
                persistent=False)
        self.drop = nn.Dropout(config.dropout)
        llama = config.arch == "llama"
        self.blocks = nn.ModuleList([
            LlamaBlock(config, CausalSelfAttention(config)) if llama else Block(config)
            for _ in range(config.n_layers)])
        self.ln_f: nn.Module = (RMSNorm(config.d_model, config.layer_norm_eps) if llama
                                else nn.LayerNorm(config.d_model, eps=config.layer_norm_eps))
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
        last_logits_only: bool = False,
    ) -> GPTOutput:
        """``last_logits_only`` returns logits (B, 1, vocab) for the last position: all a
        decoding step needs, and at GPT-2's 50,257 tokens the head is the largest matmul."""
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

        rotary = None
        if self.rotary is not None:
            rotary = self.rotary(position_ids)  # cos, sin (B, T, hs)
            x = self.drop(self.tok_emb(input_ids))  # (B, T, d)
        else:
            x = self.drop(self.tok_emb(input_ids) + self.positions(position_ids))  # (B, T, d)
        present: KVCache = []
        intermediates: list[AttentionIntermediates] = []
        for i, block in enumerate(self.blocks):
            past = past_key_values[i] if past_key_values else None
            if rotary is not None:
                x, layer_present, inter = block(x, allowed, past, return_intermediates, rotary)
            else:
                x, layer_present, inter = block(x, allowed, past, return_intermediates)
            present.append(layer_present)
            if inter is not None:
                intermediates.append(inter)
        if last_logits_only:
            if targets is not None:
                raise ValueError("last_logits_only cannot compute a loss over the sequence")
            x = x[:, -1:]  # (B, 1, d)
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
