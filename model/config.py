"""Typed model configuration that travels with every checkpoint as config.json.

Following nanoGPT, the checkpoint stores the model arguments and the loader rebuilds
``GPTConfig(**args)``; nothing is ever exec'd or unpickled. The fields are shared by
every architecture; which values a family computes (positions, activations, grouped
key/value heads, extra biases) is its own module's call (model/architectures/), asked
when a config is built: the registry is torch-free, the family's module imports torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from model.architectures import architecture
from service.contract.heads import HeadGeometry

PositionKind = Literal["learned", "sinusoidal", "rope"]


@dataclass(frozen=True)
class GPTConfig(HeadGeometry):
    """Dimensions and switches of the decoder-only transformer."""

    vocab_size: int
    d_model: int = 512
    n_heads: int = 8
    n_layers: int = 6
    d_ff: int = 2048
    max_seq_len: int = 256
    dropout: float = 0.0
    position: PositionKind = "learned"  # rope: rotary angles instead of embeddings
    # gpt: relu, gelu (exact erf), gelu_tanh (GPT-2's gelu_new); llama: silu (SwiGLU)
    activation: str = "relu"
    tie_weights: bool = False
    layer_norm_eps: float = 1e-5
    # GPT-2 has a bias on every Q/K/V/output projection; the seeds' model has none. False
    # keeps checkpoints written before the field existed loading unchanged.
    attn_bias: bool = False
    # The family (model/architectures/): "gpt" (GPT-2's blocks) or "llama" (RMSNorm,
    # SwiGLU, rotary, grouped-query attention). Every default is the GPT behaviour, so
    # older checkpoints load unchanged.
    arch: str = "gpt"
    n_kv_heads: int | None = None  # key/value heads (GQA); None: one per query head
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # transformers' rope_scaling, checked
    qkv_bias: bool = False  # biases on Q/K/V only (Qwen2); attn_bias covers all four
    mlp_bias: bool = False  # biases on the SwiGLU projections (Llama's mlp_bias)
    # Each head's width when it is not d_model / n_heads (Qwen3-0.6B: 16 heads of 128 over
    # a d_model of 1024): Q and the attention output are n_heads·head_size wide.
    head_size: int | None = None
    qk_norm: bool = False  # an RMSNorm on each head's query and key before rotary (Qwen3)
    # layers whose attention has no rotary positions at all ("NoPE", SmolLM3: every fourth)
    nope_layers: tuple[int, ...] = ()
    # every layer attends to the last sliding_window positions only, itself included
    # (Mistral's sliding-window attention); None: the whole past
    sliding_window: int | None = None
    # the Hugging Face checkpoint's layout fuses Q/K/V (qkv_proj) and the SwiGLU gate and
    # up projections (gate_up_proj), as Phi-3 stores them; what is computed is Llama's
    fused_projections: bool = False
    # dimensions of each head the rotary angles turn (the first ones; Phi-4-mini: 96 of
    # 128); None: all of them
    rotary_dim: int | None = None
    # Gemma 3: the embedding times √d_model; a norm after attention and after the MLP as
    # well as before (sandwich); the query scale (query_pre_attn_scalar^-1/2; None:
    # 1/√head_dim); the sliding window on these layers only (empty: every layer); their
    # own rotary base
    embed_scale: bool = False
    post_norms: bool = False
    attn_scale: float | None = None
    window_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None

    def __post_init__(self) -> None:
        arch = architecture(self.arch)  # UnknownArchitecture lists the registered ones
        checks = {
            "vocab_size": self.vocab_size > 0,
            "d_model": self.d_model > 0,
            "n_heads": self.n_heads > 0 and (self.head_size is not None
                                             or self.d_model % max(self.n_heads, 1) == 0),
            "head_size": self.head_size is None or self.head_size > 0,
            "sliding_window": self.sliding_window is None or self.sliding_window > 0,
            "rotary_dim": self.rotary_dim is None or (
                0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0),
            "nope_layers": all(0 <= i < self.n_layers for i in self.nope_layers) and (
                not self.nope_layers or self.position == "rope"),
            "n_layers": self.n_layers > 0,
            "d_ff": self.d_ff > 0,
            "max_seq_len": self.max_seq_len > 0,
            "dropout": 0.0 <= self.dropout < 1.0,
            "layer_norm_eps": self.layer_norm_eps > 0,
            "n_kv_heads": self.n_kv_heads is None or (
                self.n_kv_heads > 0 and self.n_heads % self.n_kv_heads == 0),
            "rope_theta": self.rope_theta > 0,
        }
        bad = list(dict.fromkeys([name for name, ok in checks.items() if not ok]
                                 + arch.check_config(self)))
        if bad:
            raise ValueError(f"invalid GPTConfig field(s) {bad}: {self}")
        if self.position == "sinusoidal" and self.d_model % 2:
            raise ValueError("sinusoidal positions need an even d_model")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError("rotary positions need an even head_dim")
        if self.rope_scaling is not None:
            from model.rotary import check_rope_scaling

            check_rope_scaling(self.rope_scaling)

    @property
    def rotary_dims(self) -> int:
        """The dimensions of a head the rotary angles turn: its first ``rotary_dim``."""
        return self.rotary_dim if self.rotary_dim is not None else self.head_dim

    @property
    def attention_width(self) -> int:
        """Q's and the attention output's width: n_heads · head_dim (d_model unless
        ``head_size`` sets another)."""
        return self.n_heads * self.head_dim

    def windowed(self, layer: int) -> bool:
        """Whether layer ``layer`` sees the last ``sliding_window`` positions only."""
        return self.sliding_window is not None and (
            not self.window_layers or layer in self.window_layers)

    def local_rotary(self, layer: int) -> bool:
        """Whether layer ``layer`` rotates with ``local_rope_theta`` (Gemma 3's window
        layers) rather than ``rope_theta`` and its scaling."""
        return self.local_rope_theta is not None and self.windowed(layer)

    def rotates(self, layer: int) -> bool:
        """Whether layer ``layer`` rotates its queries and keys (rotary models but their
        NoPE layers)."""
        return self.position == "rope" and layer not in self.nope_layers

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPTConfig:
        """Rebuild from JSON, rejecting unknown keys so a typo never goes unnoticed."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown GPTConfig keys: {unknown}")
        for name in ("nope_layers", "window_layers"):  # JSON lists
            if name in data:
                data = {**data, name: tuple(data[name])}
        return cls(**data)

    def num_params_closed_form(self) -> int:
        """Parameter count from the architecture's formula (seed 002's 2VD + L(4D² + 2DF +
        4D), adapted per family); exact, a tied head counted once."""
        return architecture(self.arch).num_params(self)


@dataclass(frozen=True)
class Preset:
    """A named model size plus the training schedule that suits it on 2 CPU cores."""

    d_model: int
    n_heads: int
    n_layers: int
    d_ff: int
    max_seq_len: int
    vocab_size: int
    batch_size: int
    learning_rate: float
    steps: int
    arch: str = "gpt"
    n_kv_heads: int | None = None


PRESETS: dict[str, Preset] = {
    # Seconds on a laptop: for the tests.
    "tiny": Preset(d_model=64, n_heads=4, n_layers=2, d_ff=256, max_seq_len=128,
                   vocab_size=512, batch_size=16, learning_rate=3e-3, steps=100),
    # The default model `make run` builds: about three minutes on 2 CPU cores.
    "small": Preset(d_model=256, n_heads=4, n_layers=4, d_ff=1024, max_seq_len=256,
                    vocab_size=4096, batch_size=8, learning_rate=3e-3, steps=360),
    # The seeds' classic configuration (d_model 512, 8 heads, 6 layers, d_ff 2048).
    "base": Preset(d_model=512, n_heads=8, n_layers=6, d_ff=2048, max_seq_len=512,
                   vocab_size=4096, batch_size=16, learning_rate=6e-4, steps=2000),
    # Llama architecture (RMSNorm, SwiGLU, rotary, grouped-query attention with a quarter
    # / a half of the key/value heads): the same budgets as tiny and small.
    "llama-tiny": Preset(d_model=64, n_heads=4, n_layers=2, d_ff=192, max_seq_len=128,
                         vocab_size=512, batch_size=16, learning_rate=3e-3, steps=100,
                         arch="llama", n_kv_heads=2),
    "llama-small": Preset(d_model=256, n_heads=8, n_layers=4, d_ff=704, max_seq_len=256,
                          vocab_size=4096, batch_size=8, learning_rate=3e-3, steps=360,
                          arch="llama", n_kv_heads=2),
}


def config_from_preset(name: str, vocab_size: int | None = None, **overrides: Any) -> GPTConfig:
    """Model config for a preset; vocab_size comes from the trained tokenizer."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[name]
    fixed = architecture(p.arch).fixed  # e.g. llama's rotary positions and SwiGLU
    overrides = {k: v for k, v in overrides.items() if k not in fixed}
    overrides.update(fixed, arch=p.arch, n_kv_heads=p.n_kv_heads)
    return GPTConfig(
        vocab_size=vocab_size if vocab_size is not None else p.vocab_size,
        d_model=p.d_model, n_heads=p.n_heads, n_layers=p.n_layers, d_ff=p.d_ff,
        max_seq_len=p.max_seq_len, **overrides,
    )
