"""Decoder-only transformer with a KV cache and full attention introspection.

The skeleton every architecture shares: token embeddings, positions (learned, sinusoidal
or rotary), N blocks and a final norm from the config's architecture
(model/architectures/), the LM head. Attention is model/attention.py's, written out as
the seeds define it. The same forward serves training (whole sequences),
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

from model.architectures import architecture
from model.attention import AttentionIntermediates, attention_allowed
from model.config import GPTConfig
from model.rotary import Rotary, inverse_frequencies

KVCache = list[tuple[Tensor, Tensor]]  # per layer: key, value each (B, nkv, T_total, hs)


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


class GPT(nn.Module):
    """Token + position embeddings, N pre-norm blocks, final norm, LM head.

    The blocks and the final norm are the architecture's (``config.arch``: GPT-2's
    LayerNorm and MLP, Llama's RMSNorm and SwiGLU ...); with rotary positions there are
    no position embeddings, the angles rotate Q and K in every layer instead.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb: nn.Embedding | None = None
        self.rotary: Rotary | None = None
        self.rotary_local: Rotary | None = None  # Gemma 3's window layers' own base
        if config.position == "learned":
            self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model)
        elif config.position == "rope":
            self.rotary = Rotary(config.rotary_dims, config.rope_theta, config.rope_scaling)
            if config.local_rope_theta is not None:
                self.rotary_local = Rotary(config.rotary_dims, config.local_rope_theta)
        else:
            self.register_buffer(
                "pos_table", sinusoidal_table(config.max_seq_len, config.d_model),
                persistent=False)
        self.drop = nn.Dropout(config.dropout)
        arch = architecture(config.arch)
        self.blocks = nn.ModuleList([arch.block(config) for _ in range(config.n_layers)])
        self.ln_f = arch.final_norm(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        if config.tie_weights:
            self.lm_head.weight = self.tok_emb.weight

    def fill_buffers(self) -> None:
        """Compute the buffers (rotary frequencies, the sinusoidal table) of a model built
        on the meta device, whose parameters were then assigned (a checkpoint holding its
        GGUF file: model/gguf/reader.py)."""
        cfg = self.config
        if self.rotary is not None:
            self.rotary.inv_freq = inverse_frequencies(cfg.rotary_dims, cfg.rope_theta,
                                                       cfg.rope_scaling)
            if self.rotary_local is not None and cfg.local_rope_theta is not None:
                self.rotary_local.inv_freq = inverse_frequencies(cfg.rotary_dims,
                                                                 cfg.local_rope_theta)
        elif self.pos_emb is None:
            self.pos_table = sinusoidal_table(cfg.max_seq_len, cfg.d_model)

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
        table: Tensor = self.pos_table
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
        past_len = past_key_values[0][0].shape[2] if past_key_values else 0
        x, context = self.embed(input_ids, attention_mask, position_ids, past_len)
        present: KVCache = []
        intermediates: list[AttentionIntermediates] = []
        for i in range(len(self.blocks)):
            past = past_key_values[i] if past_key_values else None
            x, layer_present, inter = self.layer(i, x, context, past, return_intermediates)
            present.append(layer_present)
            if inter is not None:
                intermediates.append(inter)
        if last_logits_only:
            if targets is not None:
                raise ValueError("last_logits_only cannot compute a loss over the sequence")
            x = x[:, -1:]  # (B, 1, d)
        logits = self.head(x)  # (B, T, vocab)

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

    def embed(self, input_ids: Tensor, attention_mask: Tensor | None,
              position_ids: Tensor | None, past_len: int) -> tuple[Tensor, LayerContext]:
        """The embedded tokens (B, T, d) and what every layer reads beside them: the first
        part of :meth:`forward`, apart so that a reference can run the layers one at a
        time over several inputs (export/verify/layerwise.py)."""
        b, t = input_ids.shape
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
        allowed, local = None, None  # (B, 1, T, T_total): every layer's, the window layers'
        cfg = self.config
        window = cfg.sliding_window
        if attention_mask is None and window is not None:  # a window needs a mask
            attention_mask = torch.ones(b, past_len + t, dtype=torch.long,
                                        device=input_ids.device)
        if attention_mask is not None:
            everywhere = window is not None and not cfg.window_layers
            allowed = attention_allowed(attention_mask, past_len, t,
                                        window if everywhere else None)
            if window is not None and not everywhere:
                local = attention_allowed(attention_mask, past_len, t, window)

        rotary, rotary_local = None, None
        if self.rotary is not None:
            rotary = self.rotary(position_ids)  # cos, sin (B, T, hs)
            if self.rotary_local is not None:
                rotary_local = self.rotary_local(position_ids)
            x = self.drop(self.tok_emb(input_ids))  # (B, T, d)
            if cfg.embed_scale:  # Gemma: √d in float32, as transformers scales it
                x = x * torch.tensor(cfg.d_model ** 0.5, dtype=x.dtype)
        else:
            x = self.drop(self.tok_emb(input_ids) + self.positions(position_ids))  # (B, T, d)
        return x, LayerContext(allowed, local, rotary, rotary_local)

    def layer(self, i: int, x: Tensor, context: LayerContext, past: tuple[Tensor, Tensor] | None,
              return_intermediates: bool = False
              ) -> tuple[Tensor, tuple[Tensor, Tensor], AttentionIntermediates | None]:
        """Block ``i`` over ``x`` (B, T, d): (x, its keys and values, its intermediates)."""
        cfg = self.config
        turn = (context.rotary_local if cfg.local_rotary(i) else context.rotary
                ) if cfg.rotates(i) else None
        mask = context.local if context.local is not None and cfg.windowed(i) \
            else context.allowed
        out: tuple[Tensor, tuple[Tensor, Tensor], AttentionIntermediates | None] = \
            self.blocks[i](x, mask, past, return_intermediates, turn)
        return out

    def head(self, x: Tensor) -> Tensor:
        """The final norm and the LM head: (B, T, d) → logits (B, T, vocab)."""
        logits: Tensor = self.lm_head(self.ln_f(x))
        return logits


@dataclass(frozen=True)
class LayerContext:
    """What each layer of one forward reads besides the hidden states: the attention masks
    (B, 1, T, T_total; every layer's and the window layers') and the rotary cos/sin
    (B, T, hs; the global and the window layers' tables)."""

    allowed: Tensor | None
    local: Tensor | None
    rotary: tuple[Tensor, Tensor] | None
    rotary_local: tuple[Tensor, Tensor] | None
