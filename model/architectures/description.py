"""A model as its ONNX graphs see it: shapes and every per-family choice, as plain values.

The torch modules (model/gpt.py, model/block.py, the family's norm and MLP) compute a
model; export/onnx/layers.py writes the same computation as ONNX nodes for every family
at once. What the writer must know to choose its nodes is here, built by
:meth:`model.architectures.base.Architecture.describe` from the family's two choices
(its norm and its feed-forward form) and the config's options, so a family is a few
class attributes and the config's fields rather than a set of node-writing methods, and
model/ writes no ONNX. Frozen: one value, made once per export, read by every graph.
Torch- and onnx-free, as base.py is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

NormKind = Literal["layer", "rms"]  # LayerNorm (scale and bias) or RMSNorm (scale only)
MlpForm = Literal["plain", "gated"]  # down(act(up(x))); down(act(gate(x)) ⊙ up(x))
Rotation = Literal["global", "local"]  # the model's rotary tables or the window layers'


@dataclass(frozen=True)
class LayerDescription:
    """What one block's attention does differently from the others."""

    windowed: bool  # sees the last ``sliding_window`` positions only
    rotary: Rotation | None  # which tables turn its Q and K; None: none (NoPE, or table positions)


@dataclass(frozen=True)
class Description:
    """Everything the ONNX writer reads besides the weights (model.gpt.GPT's modules)."""

    vocab_size: int
    d_model: int
    n_heads: int
    kv_heads: int
    head_dim: int
    rotary_dims: int  # of each head's dimensions, the first this many are turned
    max_seq_len: int
    norm: NormKind
    eps: float
    mlp: MlpForm
    activation: str  # relu | gelu | gelu_tanh | silu (or a kind export/onnx/layers.py was given)
    mlp_bias: bool
    qkv_bias: bool  # biases on the Q, K and V projections
    out_bias: bool  # a bias on the attention output projection
    rotary: bool  # rotary positions; otherwise a (learned or sinusoidal) table added
    sliding_window: int | None
    layers: tuple[LayerDescription, ...]
    qk_norm: bool  # a norm over each head's query and key (Qwen3, Gemma 3)
    post_norms: bool  # norms of the attention's and the MLP's outputs (Gemma 3)
    embed_scale: float | None  # the embedding times this (Gemma: √d)
    attn_scale: float | None  # the scores times this; None: divided by √head_dim
    tied_head: bool  # the LM head is the embedding matrix

    @property
    def attention_width(self) -> int:
        """Q's and the attention output's width (d_model unless the heads are wider)."""
        return self.n_heads * self.head_dim

    @property
    def global_layers(self) -> bool:
        """Some layer sees every position (it needs the causal mask without the window)."""
        return not all(layer.windowed for layer in self.layers)
