"""Typed model configuration that travels with every checkpoint as config.json.

Following nanoGPT, the checkpoint stores the model arguments and the loader rebuilds
``GPTConfig(**args)``; nothing is ever exec'd or unpickled.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

PositionKind = Literal["learned", "sinusoidal"]
ActivationKind = Literal["relu", "gelu", "gelu_tanh"]
ACTIVATIONS = ("relu", "gelu", "gelu_tanh")


@dataclass(frozen=True)
class GPTConfig:
    """Dimensions and switches of the decoder-only transformer."""

    vocab_size: int
    d_model: int = 512
    n_heads: int = 8
    n_layers: int = 6
    d_ff: int = 2048
    max_seq_len: int = 256
    dropout: float = 0.0
    position: PositionKind = "learned"
    activation: ActivationKind = "relu"  # gelu: exact erf; gelu_tanh: GPT-2's gelu_new
    tie_weights: bool = False
    layer_norm_eps: float = 1e-5
    # GPT-2 has a bias on every Q/K/V/output projection; the seeds' model has none. False
    # keeps checkpoints written before the field existed loading unchanged.
    attn_bias: bool = False

    def __post_init__(self) -> None:
        checks = {
            "vocab_size": self.vocab_size > 0,
            "d_model": self.d_model > 0,
            "n_heads": self.n_heads > 0 and self.d_model % max(self.n_heads, 1) == 0,
            "n_layers": self.n_layers > 0,
            "d_ff": self.d_ff > 0,
            "max_seq_len": self.max_seq_len > 0,
            "dropout": 0.0 <= self.dropout < 1.0,
            "position": self.position in ("learned", "sinusoidal"),
            "activation": self.activation in ACTIVATIONS,
            "layer_norm_eps": self.layer_norm_eps > 0,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid GPTConfig field(s) {bad}: {self}")
        if self.position == "sinusoidal" and self.d_model % 2:
            raise ValueError("sinusoidal positions need an even d_model")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPTConfig:
        """Rebuild from JSON, rejecting unknown keys so a typo never goes unnoticed."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown GPTConfig keys: {unknown}")
        return cls(**data)

    def num_params_closed_form(self) -> int:
        """Parameter count from the formula, adapted from seed 002's 2VD + L(4D² + 2DF + 4D).

        Exact for this architecture: Q/K/V/O projections (biased with ``attn_bias``),
        biased feed-forward layers, two LayerNorms per block, a final LayerNorm, a
        bias-free LM head that may share the token embedding, and learned positions
        (sinusoidal ones are a buffer).
        """
        v, d, f, n_layers = self.vocab_size, self.d_model, self.d_ff, self.n_layers
        embeddings = v * d + (self.max_seq_len * d if self.position == "learned" else 0)
        attention = 4 * d * d + (4 * d if self.attn_bias else 0)
        per_block = attention + (d * f + f) + (f * d + d) + 2 * (2 * d)
        head = 0 if self.tie_weights else v * d
        return embeddings + n_layers * per_block + 2 * d + head


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
}


def config_from_preset(name: str, vocab_size: int | None = None, **overrides: Any) -> GPTConfig:
    """Model config for a preset; vocab_size comes from the trained tokenizer."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[name]
    return GPTConfig(
        vocab_size=vocab_size if vocab_size is not None else p.vocab_size,
        d_model=p.d_model, n_heads=p.n_heads, n_layers=p.n_layers, d_ff=p.d_ff,
        max_seq_len=p.max_seq_len, **overrides,
    )
