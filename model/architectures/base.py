"""What an architecture module provides: the interface every family implements once.

One subclass per family (model/architectures/gpt2.py, llama.py) holds everything that
differs between families, in the three vocabularies a model passes through:

- configuration: which GPTConfig values it computes, Hugging Face config.json ↔ GPTConfig,
  GGUF metadata → config.json;
- weights: Hugging Face names ↔ ours, llama.cpp's GGUF names → ours, and the layout
  transforms between them (GPT-2's Conv1D transposes, llama.cpp's Q/K row permutation);
- computation: the PyTorch block and final norm, and the model's
  :class:`~model.architectures.description.Description` (its norm, MLP form and the
  config's options as plain values), from which export/onnx/layers.py writes every
  family's ONNX graphs.

This module imports neither torch nor a project module but the torch-free description.py,
so model/config.py can consult the registry while staying torch-free; the architectures
read a config through the read-only :class:`ModelConfig` view that model.config.GPTConfig
satisfies.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from model.architectures.description import Description, LayerDescription, MlpForm, NormKind

if TYPE_CHECKING:
    import gguf
    from torch import Tensor, nn


class ModelConfig(Protocol):
    """The fields of model.config.GPTConfig an architecture reads (read-only)."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def d_model(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def d_ff(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def dropout(self) -> float: ...
    @property
    def position(self) -> str: ...
    @property
    def activation(self) -> str: ...
    @property
    def tie_weights(self) -> bool: ...
    @property
    def layer_norm_eps(self) -> float: ...
    @property
    def attn_bias(self) -> bool: ...
    @property
    def arch(self) -> str: ...
    @property
    def n_kv_heads(self) -> int | None: ...
    @property
    def rope_theta(self) -> float: ...
    @property
    def rope_scaling(self) -> dict[str, Any] | None: ...
    @property
    def qkv_bias(self) -> bool: ...
    @property
    def mlp_bias(self) -> bool: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def attention_width(self) -> int: ...
    @property
    def qk_norm(self) -> bool: ...
    @property
    def nope_layers(self) -> tuple[int, ...]: ...
    @property
    def sliding_window(self) -> int | None: ...
    @property
    def fused_projections(self) -> bool: ...
    @property
    def rotary_dims(self) -> int: ...
    @property
    def embed_scale(self) -> bool: ...
    @property
    def post_norms(self) -> bool: ...
    @property
    def attn_scale(self) -> float | None: ...
    @property
    def local_rope_theta(self) -> float | None: ...
    @property
    def window_layers(self) -> tuple[int, ...]: ...
    def windowed(self, layer: int) -> bool: ...
    def local_rotary(self, layer: int) -> bool: ...
    def rotates(self, layer: int) -> bool: ...
    @property
    def kv_heads(self) -> int: ...


Refuse = Callable[[str], Exception]  # reason → the exception an importer raises


def gguf_key(meta: dict[str, Any], family: str, refuse: Refuse) -> Callable[[str], Any]:
    """A reader of ``{family}.NAME`` metadata keys that refuses a missing one."""
    def key(name: str) -> Any:
        if meta.get(f"{family}.{name}") is None:
            raise refuse(f"metadata key {family}.{name} is missing")
        return meta[f"{family}.{name}"]

    return key


@dataclass(frozen=True, eq=False)
class GGUFRows:
    """Rows of one GGUF tensor, in our order: ``rows[i]`` is the file's row that is our
    parameter's row i."""

    tensor: str  # llama.cpp's name, e.g. blk.0.attn_q.weight
    rows: np.ndarray  # (our rows,) int64 indices into the file tensor's rows


@dataclass(frozen=True)
class LoRATarget:
    """One module a LoRA adapter may adapt, by transformers' name, and the linear layers of
    ours it adds to: several, in row order, where transformers fuses them (Phi-3's
    ``qkv_proj``, GPT-2's ``c_attn``), which then share A and cut B by rows. PEFT keys an
    adapter's tensors by these names, so the name is what makes an adapter portable."""

    module: str  # e.g. model.layers.0.self_attn.q_proj
    ours: tuple[str, ...]  # e.g. ("blocks.0.attn.w_q",)
    conv1d: bool = False  # GPT-2's Conv1D (in, out) weights: PEFT's fan_in_fan_out

    @property
    def kind(self) -> str:
        """What PEFT's ``target_modules`` names it: q_proj, c_attn, ..."""
        return self.module.rpartition(".")[2]


class Architecture:
    """One model family. Subclasses set the class attributes and override the methods;
    the defaults here are the parts families share or the table lookups they fill in."""

    name: str  # GPTConfig.arch, written into every checkpoint and artifact config
    hf_model_types: tuple[str, ...] = ()  # config.json model_type values it imports
    gguf_names: tuple[str, ...] = ()  # GGUF general.architecture values it imports
    positions: tuple[str, ...] = ()  # GPTConfig.position values it computes
    activations: tuple[str, ...] = ()  # GPTConfig.activation values it computes
    # Fields the family fixes whatever a preset or the train CLI asks for.
    fixed: ClassVar[Mapping[str, Any]] = {}
    grouped_kv: bool = False  # may have fewer key/value heads than query heads (GQA)
    split_biases: bool = False  # may set qkv_bias / mlp_bias apart from attn_bias
    head_options: bool = False  # may have heads wider than d / n_heads and q/k norms
    default_preset: str = "small"  # `attnserve train --arch NAME` without --preset
    # llama.cpp's tensor names → ours: whole-model tensors, and per block (a tuple of
    # several names splits a fused tensor by rows, e.g. GPT-2's attn_qkv).
    gguf_globals: ClassVar[Mapping[str, str]] = {}
    gguf_layers: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    hf_ignored_suffixes: tuple[str, ...] = ()  # buffers some files save beside weights
    hf_class: str = ""  # the transformers class(es) a weight mismatch is reported against
    hf_tokenizer_json_only: bool = False  # refuse vocab.json + merges.txt tokenizers
    # What the block's norms and feed-forward layer are (the torch modules of block() and
    # final_norm(); the ONNX writer reads them from describe()).
    norm: NormKind = "layer"
    mlp: MlpForm = "plain"

    # -- configuration -------------------------------------------------------------------
    def check_config(self, config: ModelConfig) -> list[str]:
        """Names of the fields whose values this family does not compute."""
        grouped_ok = config.n_kv_heads is None or config.n_kv_heads == config.n_heads
        return [name for name, ok in (
            ("position", config.position in self.positions),
            ("activation", config.activation in self.activations),
            ("n_kv_heads", grouped_ok or self.grouped_kv),
            ("qkv_bias/mlp_bias", self.split_biases or not (config.qkv_bias or config.mlp_bias)),
            ("head_size/qk_norm/nope_layers/sliding_window/rotary_dim/Gemma's",
             self.head_options or not (
                config.qk_norm or config.nope_layers or config.sliding_window
                or config.attention_width != config.d_model
                or config.rotary_dims != config.head_dim or config.embed_scale
                or config.post_norms or config.attn_scale is not None)),
        ) if not ok]

    def num_params(self, config: ModelConfig) -> int:
        """Parameter count from the closed-form formula (a tied head counted once)."""
        raise NotImplementedError

    def config_from_hf(self, hf: dict[str, Any], refuse: Refuse) -> Any:
        """The GPTConfig computing exactly what transformers computes for ``hf``, or
        ``raise refuse(reason)``."""
        raise NotImplementedError

    def hf_config(self, config: ModelConfig, special: dict[str, Any]) -> dict[str, Any]:
        """The config.json making transformers compute what ``config`` computes."""
        raise NotImplementedError

    def hf_config_from_gguf(self, meta: dict[str, Any], family: str,
                            tensors: Mapping[str, gguf.ReaderTensor], refuse: Refuse,
                            dequantize: Callable[[gguf.ReaderTensor], Tensor]
                            ) -> dict[str, Any]:
        """The config.json transformers would compute for a GGUF file of ``family`` (keys
        ``{family}.*``); vocab_size and tie_word_embeddings come from the caller."""
        raise NotImplementedError

    # -- weights -------------------------------------------------------------------------
    def hf_prefix(self, names: list[str]) -> str:
        """The prefix of transformers' tensor names in this file ('' when none)."""
        return ""

    def hf_expected_shapes(self, config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
        """transformers' tensors (``prefix`` included, lm_head left out) and their shapes."""
        raise NotImplementedError

    def state_dict_from_hf(self, raw: dict[str, Tensor], config: ModelConfig
                           ) -> dict[str, Tensor]:
        """transformers' tensors (prefix removed, float32) → model.gpt.GPT's."""
        raise NotImplementedError

    def state_dict_to_hf(self, model: Any) -> dict[str, Tensor]:
        """model.gpt.GPT's tensors → transformers' names and layouts (float32 copies)."""
        raise NotImplementedError

    def gguf_layer_map(self, family: str) -> Mapping[str, tuple[str, ...]]:
        """llama.cpp's per-block tensor names → ours, for files of ``family`` (default:
        ``gguf_layers``; a family whose files fuse other tensors overrides this)."""
        return self.gguf_layers

    def split_rows(self, targets: list[str], config: ModelConfig, rows: int) -> list[int]:
        """The rows of each of ``targets`` in the GGUF tensor of ``rows`` rows holding them,
        in order (default: equal parts, as GPT-2's attn_qkv)."""
        return [rows // len(targets)] * len(targets)

    def gguf_targets(self, name: str, family: str = "") -> list[str] | None:
        """Our parameter name(s) for a GGUF tensor, or None when it has none."""
        base, _, suffix = name.rpartition(".")
        if suffix not in ("weight", "bias"):
            return None
        if base in self.gguf_globals:
            return [f"{self.gguf_globals[base]}.{suffix}"]
        match = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
        if match is None:
            return None
        block, part = match.groups()
        ours = self.gguf_layer_map(family).get(part)
        return None if ours is None else [f"blocks.{block}.{o}.{suffix}" for o in ours]

    def gguf_config_tensors(self, family: str) -> tuple[str, ...]:
        """GGUF tensors read into the config rather than the weights."""
        return ()

    def from_gguf_layout(self, w: Tensor, target: str, family: str,
                         config: ModelConfig) -> Tensor:
        """Undo llama.cpp's layout of one dequantised tensor (rows, columns)."""
        return w

    def gguf_sources(self, family: str, config: ModelConfig, rows: Mapping[str, int]
                     ) -> dict[str, GGUFRows]:
        """Our parameter → the GGUF tensor holding it and which of its rows, in our order,
        for a file whose tensors have ``rows[name]`` rows: the inverse of
        :meth:`gguf_targets`, the rows reordered by :meth:`from_gguf_layout` applied to the
        row numbers, so --quantize gguf reads exactly the rows the import read. A tied
        head is the embedding's rows. A family whose layout transform is more than a row
        permutation overrides this."""
        import torch

        skip = self.gguf_config_tensors(family)
        out: dict[str, GGUFRows] = {}
        for tensor, n in rows.items():
            targets = self.gguf_targets(tensor, family)
            if targets is None or tensor in skip:
                continue
            order = self.from_gguf_layout(torch.arange(n), targets[0], family, config)  # (n,)
            sizes = self.split_rows(targets, config, n) if len(targets) > 1 else [n]
            cuts = np.cumsum(sizes)[:-1]  # where each part's rows end
            for target, part in zip(targets, np.split(order.numpy(), cuts),
                                    strict=True):  # a fused tensor: its parts' rows
                out[target] = GGUFRows(tensor, part)
        if config.tie_weights and "tok_emb.weight" in out:
            out["lm_head.weight"] = out["tok_emb.weight"]
        return out

    def lora_targets(self, config: ModelConfig) -> list[LoRATarget]:
        """Every projection a LoRA adapter may adapt, layer by layer, in transformers'
        names (model/finetune/)."""
        raise NotImplementedError

    # -- PyTorch -------------------------------------------------------------------------
    def block(self, config: ModelConfig) -> nn.Module:
        """One transformer block: forward(x, allowed, past, explicit, rotary) →
        (x, present, intermediates)."""
        raise NotImplementedError

    def final_norm(self, config: ModelConfig) -> nn.Module:
        raise NotImplementedError

    # -- the ONNX graphs -----------------------------------------------------------------
    def describe(self, config: ModelConfig) -> Description:
        """The model as export/onnx/layers.py writes it: this family's norm and MLP form,
        the config's options, per layer its window and rotary tables."""
        layers = tuple(LayerDescription(
            windowed=config.windowed(i),
            rotary=None if not config.rotates(i) else "local" if config.local_rotary(i)
            else "global") for i in range(config.n_layers))
        return Description(
            vocab_size=config.vocab_size, d_model=config.d_model, n_heads=config.n_heads,
            kv_heads=config.kv_heads, head_dim=config.head_dim,
            rotary_dims=config.rotary_dims, max_seq_len=config.max_seq_len,
            norm=self.norm, eps=float(config.layer_norm_eps), mlp=self.mlp,
            activation=config.activation,
            # the plain layer (GPT-2's) is always biased; the gated one as configured
            mlp_bias=self.mlp == "plain" or config.mlp_bias,
            qkv_bias=config.attn_bias or config.qkv_bias, out_bias=config.attn_bias,
            rotary=config.position == "rope", sliding_window=config.sliding_window,
            layers=layers, qk_norm=config.qk_norm, post_norms=config.post_norms,
            embed_scale=config.d_model ** 0.5 if config.embed_scale else None,
            attn_scale=config.attn_scale, tied_head=config.tie_weights)
