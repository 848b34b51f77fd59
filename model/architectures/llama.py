"""The Llama family (arch ``llama``): SmolLM2, TinyLlama, Llama 3, and the families that are
Llama with exceptions (Qwen2 / Qwen2.5, Qwen3, SmolLM3, Mistral, Phi-3, Gemma 3's text
model: the class's docstring says how each differs).

RMSNorm, a SwiGLU feed-forward layer, rotary positions and grouped-query attention
(model/attention.py with fewer key/value heads). Qwen2 is Llama with biases on Q/K/V alone
(``qkv_bias``); Llama itself may bias all four attention projections (``attn_bias``) and
the SwiGLU ones (``mlp_bias``). Each piece computes exactly what transformers'
LlamaRMSNorm / LlamaMLP / LlamaDecoderLayer compute in float32.

Conversions: transformers' Linear weights are already (out, in) and its rotary layout is
ours, so HF ↔ ours is a renaming. llama.cpp's converter permutes the rows of ``attn_q`` /
``attn_k`` of its ``llama`` files (not ``qwen2``) for its interleaved rotary, undone on
import, and stores Llama 3's rotary scaling as a ``rope_freqs`` tensor, read into the
config. Options that change what the network computes and that our model does not have
(other activations, logit soft-capping, partial rotary, bidirectional attention,
``use_sliding_window``, rope scalings model/rotary.py does not compute) are refused with
one line.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.architectures.base import Architecture, LoRATarget, ModelConfig, Refuse, gguf_key
from model.attention import CausalSelfAttention
from model.block import PreNormBlock
from model.config import GPTConfig
from model.rotary import inverse_frequencies

if TYPE_CHECKING:
    import gguf

HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                    "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM",
                    "gemma3_text": "Gemma3ForCausalLM"}
# llama.cpp's smollm3 graph leaves rotary out of every fourth layer (a fixed step, no key)
SMOLLM3_NOPE_STEP = 4
# transformers' names inside a layer → ours (same layouts).
RENAMES = (("self_attn.q_proj", "attn.w_q"), ("self_attn.k_proj", "attn.w_k"),
           ("self_attn.v_proj", "attn.w_v"), ("self_attn.o_proj", "attn.w_o"),
           ("mlp.gate_proj", "ffn.gate"), ("mlp.up_proj", "ffn.up"),
           ("mlp.down_proj", "ffn.down"), ("input_layernorm", "ln_1"),
           ("post_attention_layernorm", "ln_2"), ("self_attn.q_norm", "attn.q_norm"),
           ("self_attn.k_norm", "attn.k_norm"))
HF_LAYER, OUR_LAYER = "model.layers.", "blocks."
# Gemma 3's four norms a layer: post_attention_layernorm is the attention output's
GEMMA_RENAMES = (*(pair for pair in RENAMES if pair[0] != "post_attention_layernorm"),
                 ("post_attention_layernorm", "post_attn"), ("pre_feedforward_layernorm", "ln_2"),
                 ("post_feedforward_layernorm", "post_ffn"))
ROPE_FREQS = "rope_freqs.weight"
# LongRoPE's factors as llama.cpp's converter writes them for phi3 (long, short)
PHI3_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# llama.cpp permutes Q/K rows for these GGUF architectures only (qwen2 files are not).
GGUF_PERMUTED = ("llama", "smollm3")
# general.architecture → transformers' model_type, where they differ
GGUF_MODEL_TYPES = {"gemma3": "gemma3_text"}
# llama.cpp's gemma3: of every 6 layers the first 5 are window layers, unless the file
# says otherwise (attention.sliding_window_pattern), and their rotary base is 10,000
GEMMA3_WINDOW_PERIOD, GEMMA3_LOCAL_THETA = 6, 10000.0
GEMMA3_27B_LAYERS = 62  # whose query scale llama.cpp takes from d_model / n_heads
# Llama 3's rope_scaling as llama.cpp's converter assumes it when writing rope_freqs.
LLAMA3_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


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

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, f, bias = config.d_model, config.d_ff, config.mlp_bias
        self.gate = nn.Linear(d, f, bias=bias)
        self.up = nn.Linear(d, f, bias=bias)
        self.down = nn.Linear(f, d, bias=bias)
        self.dropout = nn.Dropout(config.dropout)

        self.gelu = config.activation == "gelu_tanh"  # GeGLU (Gemma), else SwiGLU

    def forward(self, x: Tensor) -> Tensor:
        gate = self.gate(x)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.dropout(self.down(act * self.up(x)))  # (B, T, d)


def _rename_layer(name: str, src: str, dst: str, pairs: Sequence[tuple[str, str]]
                  ) -> str | None:
    """``{src}{i}.{a}{rest}`` → ``{dst}{i}.{b}{rest}`` for the first (a, b) that matches;
    None for a name outside the layers or with no counterpart."""
    if not name.startswith(src):
        return None
    index, _, tail = name.removeprefix(src).partition(".")
    for a, b in pairs:
        if tail.startswith(a + "."):
            return f"{dst}{index}.{b}{tail.removeprefix(a)}"
    return None


def unpermute_rope_rows(w: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's LlamaModel.permute: within each head its rows were reordered from
    transformers' halves layout (x_i, x_{i+hs/2}) to interleaved pairs (x_2i, x_2i+1)."""
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])  # (h, hs/2, 2, ...)
            .transpose(1, 2).reshape(w.shape))  # (h·hs, ...)


class Llama(Architecture):
    """LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM / SmolLM3ForCausalLM (GGUF
    ``llama`` / ``qwen2`` / ``qwen3`` / ``smollm3``). Qwen3 is Qwen2 without biases and with
    an RMSNorm on each head's query and key before rotary (``qk_norm``), its heads often
    wider than d_model / n_heads; SmolLM3 is Llama with no rotary in some layers
    (``nope_layers``: every fourth); Mistral is Llama whose layers see the last
    ``sliding_window`` positions only; Phi-3 is Llama (with a window, in its 4k models)
    whose checkpoints fuse Q/K/V and the SwiGLU gate and up projections
    (``fused_projections``: split on import, fused again by ``--format hf``); Gemma 3's
    text model adds a scaled embedding, norms after attention and the MLP, GeGLU, its own
    query scale, and window layers with their own rotary base (its (1 + w) norms folded on
    import)."""

    name = "llama"
    hf_model_types = ("llama", "qwen2", "qwen3", "smollm3", "mistral", "phi3", "gemma3_text")
    gguf_names = ("llama", "qwen2", "qwen3", "smollm3", "phi3", "gemma3")
    positions = ("rope",)
    activations = ("silu", "gelu_tanh")  # SwiGLU, or Gemma's GeGLU
    fixed: ClassVar[Mapping[str, Any]] = {"position": "rope", "activation": "silu"}
    grouped_kv = True
    split_biases = True
    head_options = True
    default_preset = "llama-small"
    norm = "rms"
    mlp = "gated"
    hf_class = ("LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM / SmolLM3ForCausalLM / "
                "MistralForCausalLM / Phi3ForCausalLM / Gemma3ForCausalLM")
    hf_tokenizer_json_only = True
    hf_ignored_suffixes = (".rotary_emb.inv_freq",)
    # llama.cpp's llama / qwen2 tensors (rope_freqs goes into the config).
    gguf_globals: ClassVar[Mapping[str, str]] = {
        "token_embd": "tok_emb", "output_norm": "ln_f", "output": "lm_head"}
    gguf_layers: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "attn_norm": ("ln_1",), "ffn_norm": ("ln_2",), "attn_q": ("attn.w_q",),
        "attn_k": ("attn.w_k",), "attn_v": ("attn.w_v",), "attn_output": ("attn.w_o",),
        "attn_q_norm": ("attn.q_norm",), "attn_k_norm": ("attn.k_norm",),
        "ffn_gate": ("ffn.gate",), "ffn_up": ("ffn.up",), "ffn_down": ("ffn.down",),
        # Gemma 3's norms of the attention's and the MLP's outputs (ffn_norm is the one
        # before the MLP, as in Llama)
        "post_attention_norm": ("post_attn",), "post_ffw_norm": ("post_ffn",)}

    def gguf_layer_map(self, family: str) -> Mapping[str, tuple[str, ...]]:
        if family != "phi3":
            return self.gguf_layers
        # Phi-3's files fuse Q/K/V (attn_qkv) and the gate and up projections (ffn_up)
        layers = {k: v for k, v in self.gguf_layers.items() if k != "ffn_gate"}
        return {**layers, "attn_qkv": ("attn.w_q", "attn.w_k", "attn.w_v"),
                "ffn_up": ("ffn.gate", "ffn.up")}

    def split_rows(self, targets: list[str], config: ModelConfig, rows: int) -> list[int]:
        sizes = {"attn.w_q": config.attention_width,
                 "attn.w_k": config.kv_heads * config.head_dim,
                 "attn.w_v": config.kv_heads * config.head_dim,
                 "ffn.gate": config.d_ff, "ffn.up": config.d_ff}
        return [sizes[t.split(".", 2)[2].rsplit(".", 1)[0]] for t in targets]

    # -- configuration -------------------------------------------------------------------
    def num_params(self, config: ModelConfig) -> int:
        """Embedding, Q/K/V/O with kv-head-sized K and V (and their optional biases),
        SwiGLU's three matrices, two RMSNorms per block, final RMSNorm, head."""
        v, d, f, n_layers = config.vocab_size, config.d_model, config.d_ff, config.n_layers
        head = 0 if config.tie_weights else v * d
        kv, width = config.kv_heads * config.head_dim, config.attention_width
        attention = 2 * d * width + 2 * d * kv
        attention += (width + 2 * kv if config.qkv_bias or config.attn_bias else 0)  # biases
        attention += d if config.attn_bias else 0  # output projection bias
        attention += 2 * config.head_dim if config.qk_norm else 0  # q_norm, k_norm
        mlp = 3 * d * f + (2 * f + d if config.mlp_bias else 0)
        return v * d + n_layers * (attention + mlp + 2 * d) + d + head

    def config_from_hf(self, hf: dict[str, Any], refuse: Refuse) -> GPTConfig:
        model_type = str(hf.get("model_type"))
        architecture = HF_ARCHITECTURES[model_type]
        architectures = hf.get("architectures") or [architecture]
        if architectures != [architecture]:
            raise refuse(f"architectures {architectures} are not supported for model_type "
                         f"{model_type!r}; only {architecture} (a causal language model) is")
        if hf.get("quantization_config"):
            raise refuse("quantized checkpoints (quantization_config) are not supported; "
                         "import the float weights")
        gemma = model_type == "gemma3_text"
        act = hf.get("hidden_activation" if gemma else "hidden_act", "silu")
        if act != ("gelu_pytorch_tanh" if gemma else "silu"):
            raise refuse(f"hidden_act {act!r} is not supported (SwiGLU's silu; Gemma's "
                         "gelu_pytorch_tanh)")
        for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
            if hf.get(cap) is not None:
                raise refuse(f"{cap} {hf[cap]} is not supported")
        if hf.get("use_bidirectional_attention"):
            raise refuse("use_bidirectional_attention is not supported (a causal decoder)")
        if model_type in ("qwen2", "qwen3", "smollm3") and hf.get("use_sliding_window", False):
            raise refuse("use_sliding_window=true is not supported (full attention only)")
        partial = float(hf.get("partial_rotary_factor", 1.0))
        if partial != 1.0 and model_type != "phi3":
            raise refuse(f"partial_rotary_factor {hf['partial_rotary_factor']} is not "
                         "supported (rotary over the whole head only)")
        try:
            d_model = int(hf.get("hidden_size", 4096))
            n_heads = int(hf.get("num_attention_heads", 32))
            head_dim = int(hf.get("head_dim") or d_model // n_heads)
            wide = head_dim * n_heads != d_model
            n_kv = hf.get("num_key_value_heads")
            llama = model_type in ("llama", "smollm3", "mistral", "phi3", "gemma3_text")
            qwen3 = model_type in ("qwen3", "gemma3_text")  # attention_bias on all four, q/k norms
            nope = _nope_layers(hf, int(hf.get("num_hidden_layers", 32)), refuse) \
                if model_type == "smollm3" else ()
            return GPTConfig(
                vocab_size=int(hf.get("vocab_size", 32000 if llama else 151936)),
                d_model=d_model,
                n_heads=n_heads,
                n_layers=int(hf.get("num_hidden_layers", 32)),
                d_ff=int(hf.get("intermediate_size", 11008)),
                max_seq_len=_context(hf, 2048 if llama else 32768),
                position="rope",
                activation="gelu_tanh" if gemma else "silu",
                # absent, transformers takes the class default: SmolLM3Config's ties
                tie_weights=bool(hf.get("tie_word_embeddings",
                                        model_type in ("smollm3", "gemma3_text"))),
                layer_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                attn_bias=bool(hf.get("attention_bias", False)) if llama or qwen3 else False,
                arch="llama",
                n_kv_heads=int(n_kv) if n_kv is not None else None,
                rope_theta=float(hf.get("rope_theta", 10000.0)),
                rope_scaling=_scaling(hf),
                qkv_bias=model_type == "qwen2",
                mlp_bias=bool(hf.get("mlp_bias", False)) if llama else False,
                head_size=head_dim if wide else None,
                qk_norm=qwen3,
                nope_layers=nope,
                **({} if gemma else _window(hf, model_type)),
                fused_projections=model_type == "phi3",
                rotary_dim=int(head_dim * partial) if partial != 1.0 else None,
                **(_gemma3(hf, refuse) if gemma else {}),
            )
        except (TypeError, ValueError) as exc:
            raise refuse(f"unsupported configuration: {exc}") from exc

    def hf_config(self, config: ModelConfig, special: dict[str, Any]) -> dict[str, Any]:
        """LlamaConfig, Qwen2Config for Q/K/V biases alone, or Qwen3Config for per-head
        query/key norms: the inverse of :meth:`config_from_hf`."""
        qwen2 = config.qkv_bias and not config.attn_bias
        if config.qk_norm and (config.qkv_bias or config.mlp_bias):
            raise ValueError("per-head query/key norms with Q/K/V-only or SwiGLU biases have "
                             "no transformers equivalent (Qwen3 biases all four attention "
                             "projections or none)")
        if qwen2 and config.mlp_bias:
            raise ValueError("Q/K/V biases with SwiGLU biases have no transformers equivalent "
                             "(Qwen2 has no mlp_bias, Llama biases all four attention "
                             "projections)")
        if config.nope_layers and (config.qk_norm or qwen2):
            raise ValueError("layers without rotary beside Qwen's biases or query/key norms "
                             "have no transformers equivalent (SmolLM3 is Llama's body)")
        if config.fused_projections and (config.nope_layers or config.qk_norm or qwen2
                                         or config.attn_bias or config.mlp_bias):
            raise ValueError("fused projections beside biases, query/key norms or layers "
                             "without rotary have no transformers equivalent (Phi-3 is "
                             "Llama's body without biases)")
        if config.sliding_window is not None and not config.fused_projections \
                and not config.post_norms and (
                config.nope_layers or config.qk_norm or qwen2 or config.attn_bias
                or config.mlp_bias):
            raise ValueError("a sliding window beside biases, query/key norms or layers "
                             "without rotary has no transformers equivalent (Mistral is "
                             "Llama's body without biases)")
        model_type = ("gemma3_text" if config.post_norms else "phi3"
                      if config.fused_projections else "mistral"
                      if config.sliding_window is not None else "smollm3"
                      if config.nope_layers else "qwen3" if config.qk_norm
                      else "qwen2" if qwen2 else "llama")
        values: dict[str, Any] = {
            "architectures": [HF_ARCHITECTURES[model_type]],
            "model_type": model_type,
            "vocab_size": config.vocab_size, "hidden_size": config.d_model,
            "intermediate_size": config.d_ff, "num_hidden_layers": config.n_layers,
            "num_attention_heads": config.n_heads, "num_key_value_heads": config.kv_heads,
            "max_position_embeddings": config.max_seq_len,
            "rms_norm_eps": config.layer_norm_eps,
            "rope_theta": config.rope_theta, "rope_scaling": config.rope_scaling,
            "hidden_act": "silu", "tie_word_embeddings": config.tie_weights,
            "attention_dropout": 0.0, "use_cache": True, "torch_dtype": "float32",
            "bos_token_id": special.get("bos_token_id"),
            "eos_token_id": special.get("eos_token_id"),
            "pad_token_id": special.get("pad_token_id"),
        }
        if model_type in ("qwen2", "qwen3"):
            values.update(use_sliding_window=False, sliding_window=None,
                          max_window_layers=config.n_layers)
        if model_type == "qwen3":
            values.update(head_dim=config.head_dim, attention_bias=config.attn_bias)
        elif model_type == "gemma3_text":
            scale = config.attn_scale if config.attn_scale is not None else \
                config.head_dim ** -0.5
            values.update(
                head_dim=config.head_dim, attention_bias=config.attn_bias,
                query_pre_attn_scalar=round(scale ** -2, 6),
                sliding_window=config.sliding_window or config.max_seq_len,
                layer_types=["sliding_attention" if config.windowed(i) else "full_attention"
                             for i in range(config.n_layers)],
                rope_local_base_freq=config.local_rope_theta,
                hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None,
                attn_logit_softcapping=None)
        elif model_type == "mistral":
            values.update(sliding_window=config.sliding_window, head_dim=config.head_dim)
        elif model_type == "phi3":
            values.update(sliding_window=config.sliding_window,
                          original_max_position_embeddings=config.max_seq_len,
                          partial_rotary_factor=config.rotary_dims / config.head_dim)
        elif model_type == "smollm3":
            values.update(attention_bias=config.attn_bias, mlp_bias=config.mlp_bias,
                          no_rope_layers=[int(config.rotates(i))
                                          for i in range(config.n_layers)])
        elif model_type == "llama":
            values.update(head_dim=config.head_dim, attention_bias=config.attn_bias,
                          mlp_bias=config.mlp_bias, pretraining_tp=1)
        return values

    def hf_config_from_gguf(self, meta: dict[str, Any], family: str,
                            tensors: Mapping[str, gguf.ReaderTensor], refuse: Refuse,
                            dequantize: Callable[[gguf.ReaderTensor], Tensor]
                            ) -> dict[str, Any]:
        key = gguf_key(meta, family, refuse)
        d, heads = int(key("embedding_length")), int(key("attention.head_count"))
        kv_heads = meta.get(f"{family}.attention.head_count_kv", heads)
        if isinstance(kv_heads, list):  # per-layer counts: all equal or refused
            if len(set(kv_heads)) != 1:
                raise refuse(f"per-layer key/value head counts {sorted(set(kv_heads))} are "
                             "not supported")
            kv_heads = kv_heads[0]
        head_dim = int(meta.get(f"{family}.attention.key_length", d // heads))
        # phi3's rotary is NEOX-style, the first rope.dimension_count dimensions of a head
        # in halves, as transformers' partial rotary (Phi-4-mini); llama's is permuted
        partial = 1.0
        if family == "phi3" and meta.get(f"{family}.rope.dimension_count") is not None:
            partial = int(meta[f"{family}.rope.dimension_count"]) / head_dim
        for name in ("rope.dimension_count", "attention.value_length"):
            if name == "rope.dimension_count" and family == "phi3":
                continue
            value = meta.get(f"{family}.{name}")
            if value is not None and int(value) != head_dim:
                raise refuse(f"{family}.{name} {value} ≠ head width {head_dim} is not "
                             "supported (partial rotary, or values of another width)")
        theta = float(meta.get(f"{family}.rope.freq_base", 10000.0))
        longrope = any(t in tensors for t in PHI3_ROPE_FACTORS)
        if longrope and family != "phi3":
            raise refuse("rope_factors_long / rope_factors_short are supported in phi3 files "
                         f"only, not {family}")
        biased = family in ("llama", "qwen3", "smollm3")  # their biases load when present
        layers = int(key("block_count"))
        nope = {"no_rope_layers": [int((i + 1) % SMOLLM3_NOPE_STEP != 0) for i in range(layers)]
                } if family == "smollm3" else {}
        model_type = GGUF_MODEL_TYPES.get(family, family)
        gemma = _gemma3_from_gguf(meta, layers, d, heads, head_dim, refuse) \
            if family == "gemma3" else {}
        return {**nope,
            "model_type": model_type, "architectures": [HF_ARCHITECTURES[model_type]],
            "hidden_size": d, "num_attention_heads": heads,
            "num_key_value_heads": int(kv_heads), "num_hidden_layers": key("block_count"),
            "intermediate_size": key("feed_forward_length"),
            "max_position_embeddings": key("context_length"),
            "rms_norm_eps": key("attention.layer_norm_rms_epsilon"), "rope_theta": theta,
            "rope_scaling": (_phi3_longrope(meta, tensors, refuse, dequantize) if longrope
                             else _rope_scaling(meta, family, tensors, head_dim, theta, refuse,
                                                dequantize)),
            "original_max_position_embeddings": meta.get(
                f"{family}.rope.scaling.original_context_length"),
            "hidden_act": "silu",
            "attention_bias": biased and "blk.0.attn_q.bias" in tensors,
            "mlp_bias": family in ("llama", "smollm3") and "blk.0.ffn_gate.bias" in tensors,
            "head_dim": head_dim, "partial_rotary_factor": partial,
            # llama.cpp runs phi3 files without their window ("Phi SWA is currently
            # disabled", src/models/phi3.cpp); a file is served as llama.cpp runs it
            "sliding_window": (None if family == "phi3"
                               else meta.get(f"{family}.attention.sliding_window")),
            **gemma,
        }

    # -- weights -------------------------------------------------------------------------
    def hf_expected_shapes(self, config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
        """The tensors with transformers' ``model.`` prefix, without lm_head."""
        d, f, v = config.d_model, config.d_ff, config.vocab_size
        kv, w, hs = config.kv_heads * config.head_dim, config.attention_width, config.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d),
                                              "model.norm.weight": (d,)}
        qkv_biased = config.qkv_bias or config.attn_bias
        for i in range(config.n_layers):
            p = f"model.layers.{i}"
            shapes.update({
                f"{p}.input_layernorm.weight": (d,),
                f"{p}.post_attention_layernorm.weight": (d,),
                f"{p}.self_attn.q_proj.weight": (w, d), f"{p}.self_attn.k_proj.weight": (kv, d),
                f"{p}.self_attn.v_proj.weight": (kv, d), f"{p}.self_attn.o_proj.weight": (d, w),
                f"{p}.mlp.gate_proj.weight": (f, d), f"{p}.mlp.up_proj.weight": (f, d),
                f"{p}.mlp.down_proj.weight": (d, f),
            })
            if config.post_norms:  # Gemma 3: a norm after attention and around the MLP
                shapes.update({f"{p}.pre_feedforward_layernorm.weight": (d,),
                               f"{p}.post_feedforward_layernorm.weight": (d,)})
            if config.fused_projections:  # Phi-3's checkpoint layout
                for name in ("q_proj", "k_proj", "v_proj"):
                    del shapes[f"{p}.self_attn.{name}.weight"]
                del shapes[f"{p}.mlp.gate_proj.weight"], shapes[f"{p}.mlp.up_proj.weight"]
                shapes.update({f"{p}.self_attn.qkv_proj.weight": (w + 2 * kv, d),
                               f"{p}.mlp.gate_up_proj.weight": (2 * f, d)})
            if config.qk_norm:
                shapes.update({f"{p}.self_attn.q_norm.weight": (hs,),
                               f"{p}.self_attn.k_norm.weight": (hs,)})
            if qkv_biased:
                shapes.update({f"{p}.self_attn.q_proj.bias": (w,),
                               f"{p}.self_attn.k_proj.bias": (kv,),
                               f"{p}.self_attn.v_proj.bias": (kv,)})
            if config.attn_bias:
                shapes[f"{p}.self_attn.o_proj.bias"] = (d,)
            if config.mlp_bias:
                shapes.update({f"{p}.mlp.gate_proj.bias": (f,), f"{p}.mlp.up_proj.bias": (f,),
                               f"{p}.mlp.down_proj.bias": (d,)})
        return shapes

    def state_dict_from_hf(self, raw: dict[str, Tensor], config: ModelConfig
                           ) -> dict[str, Tensor]:
        if config.fused_projections:
            raw = _unfused(raw, config)
        renames = GEMMA_RENAMES if config.post_norms else RENAMES
        out: dict[str, Tensor] = {"tok_emb.weight": raw["model.embed_tokens.weight"],  # (V, d)
                                  "ln_f.weight": raw["model.norm.weight"]}  # (d,)
        for name, tensor in raw.items():
            if (ours := _rename_layer(name, HF_LAYER, OUR_LAYER, renames)) is not None:
                out[ours] = tensor
        if config.post_norms:  # Gemma's norms scale by (1 + w): folded, in float32 as it adds
            for name in [n for n in out if n.endswith("norm.weight") or ".ln_" in n
                         or n.startswith("ln_f") or ".post_" in n]:
                out[name] = 1.0 + out[name].float()
        # Tied: the head is the embedding whatever lm_head.weight a file may also hold.
        out["lm_head.weight"] = (raw["model.embed_tokens.weight"] if config.tie_weights
                                 else raw["lm_head.weight"])
        return out

    def state_dict_to_hf(self, model: Any) -> dict[str, Tensor]:
        config: ModelConfig = model.config
        state = {k: v.detach().to(torch.float32).contiguous().clone()
                 for k, v in model.state_dict().items()}
        out: dict[str, Tensor] = {"model.embed_tokens.weight": state["tok_emb.weight"],
                                  "model.norm.weight": state["ln_f.weight"]}
        back = [(ours, theirs) for theirs, ours in (GEMMA_RENAMES if config.post_norms
                                                    else RENAMES)]
        for name, tensor in state.items():
            if not name.startswith(OUR_LAYER):
                continue
            theirs = _rename_layer(name, OUR_LAYER, HF_LAYER, back)
            if theirs is None:
                raise ValueError(f"no transformers name for {name}")
            out[theirs] = tensor
        if config.post_norms:  # Gemma's norms store w of (1 + w)
            for name in [n for n in out if n.endswith(("norm.weight", "layernorm.weight"))]:
                out[name] = out[name] - 1.0
        if not config.tie_weights:
            out["lm_head.weight"] = state["lm_head.weight"]
        return _fused(out, config) if config.fused_projections else out

    def lora_targets(self, config: ModelConfig) -> list[LoRATarget]:
        """q/k/v/o_proj and gate/up/down_proj of every layer; Phi-3's fused qkv_proj and
        gate_up_proj where its checkpoints fuse them."""
        if config.fused_projections:
            parts: Sequence[tuple[str, tuple[str, ...]]] = (
                ("self_attn.qkv_proj", ("attn.w_q", "attn.w_k", "attn.w_v")),
                ("self_attn.o_proj", ("attn.w_o",)),
                ("mlp.gate_up_proj", ("ffn.gate", "ffn.up")), ("mlp.down_proj", ("ffn.down",)))
        else:
            parts = [(theirs, (ours,)) for theirs, ours in RENAMES if theirs.endswith("_proj")]
        return [LoRATarget(f"{HF_LAYER}{i}.{theirs}", tuple(f"{OUR_LAYER}{i}.{o}" for o in ours))
                for i in range(config.n_layers) for theirs, ours in parts]

    def gguf_config_tensors(self, family: str) -> tuple[str, ...]:
        if family == "phi3":
            return PHI3_ROPE_FACTORS
        return (ROPE_FREQS,) if family in ("llama", "smollm3") else ()

    def from_gguf_layout(self, w: Tensor, target: str, family: str,
                         config: ModelConfig) -> Tensor:
        if family not in GGUF_PERMUTED:
            return w
        if target.endswith(("attn.w_q.weight", "attn.w_q.bias")):
            return unpermute_rope_rows(w, config.n_heads)
        if target.endswith(("attn.w_k.weight", "attn.w_k.bias")):
            return unpermute_rope_rows(w, config.kv_heads)
        return w

    # -- PyTorch -------------------------------------------------------------------------
    def block(self, config: ModelConfig) -> nn.Module:
        """RMSNorm before attention (grouped, rotary) and before SwiGLU."""
        d, eps = config.d_model, config.layer_norm_eps
        attn = CausalSelfAttention(config)
        if config.qk_norm:  # Qwen3: each head's query and key, over head_dim
            attn.q_norm, attn.k_norm = RMSNorm(config.head_dim, eps), RMSNorm(config.head_dim, eps)
        post = ((RMSNorm(d, eps), RMSNorm(d, eps)) if config.post_norms else (None, None))
        return PreNormBlock(RMSNorm(d, eps), attn, RMSNorm(d, eps), SwiGLU(config),
                            config.dropout, *post)

    def final_norm(self, config: ModelConfig) -> nn.Module:
        return RMSNorm(config.d_model, config.layer_norm_eps)


_FUSED = (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
          ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")))


def _fused_rows(config: ModelConfig) -> dict[str, list[int]]:
    """Rows of each part of Phi-3's fused projections: q | k | v and gate | up."""
    kv = config.kv_heads * config.head_dim
    return {"self_attn.qkv_proj": [config.attention_width, kv, kv],
            "mlp.gate_up_proj": [config.d_ff, config.d_ff]}


def _unfused(raw: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """Phi-3's qkv_proj and gate_up_proj cut by rows into Llama's names (each its own
    tensor: a checkpoint saves no views of a larger storage)."""
    rows = _fused_rows(config)
    out = dict(raw)
    for name, tensor in raw.items():
        for fused, parts in _FUSED:
            if name.endswith(f"{fused}.weight"):
                del out[name]
                for part, piece in zip(parts, tensor.split(rows[fused]), strict=True):
                    out[name.replace(fused, part)] = piece.clone()
    return out


def _fused(state: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """Llama's names joined back into Phi-3's qkv_proj and gate_up_proj."""
    out = dict(state)
    for i in range(config.n_layers):
        p = f"{HF_LAYER}{i}."
        for fused, parts in _FUSED:
            out[f"{p}{fused}.weight"] = torch.cat([out.pop(f"{p}{part}.weight")
                                                   for part in parts])
    return out


def _window(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    return {"sliding_window": _sliding_window(hf, model_type)}


def _gemma3(hf: dict[str, Any], refuse: Refuse) -> dict[str, Any]:
    """Gemma 3's fields beyond Llama's: the scaled embedding, the sandwich norms, the query
    scale, its window layers (layer_types) and their rotary base."""
    layers = int(hf.get("num_hidden_layers", 26))
    kinds = hf.get("layer_types") or [
        "full_attention" if (i + 1) % int(hf.get("sliding_window_pattern", 6)) == 0
        else "sliding_attention" for i in range(layers)]
    if len(kinds) != layers or set(kinds) - {"sliding_attention", "full_attention"}:
        raise refuse(f"layer_types {kinds} are not {layers} of sliding_attention / "
                     "full_attention")
    local = tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention")
    window = hf.get("sliding_window")
    return {"embed_scale": True, "post_norms": True,
            "attn_scale": float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
            "sliding_window": int(window) if window and local else None,
            "window_layers": local if window and local else (),
            "local_rope_theta": float(hf.get("rope_local_base_freq", 10000.0))}


def _gemma3_from_gguf(meta: dict[str, Any], layers: int, d: int, heads: int, head_dim: int,
                      refuse: Refuse) -> dict[str, Any]:
    """A gemma3 file's config as llama.cpp runs it (src/models/gemma3.cpp), which differs
    from transformers' GGUF loader where the file is silent: the window pattern (a period,
    5 window layers then a global one, or a per-layer list), the window layers' rotary base
    (rope.freq_base_swa, else 10,000) and the query scale, which the file does not hold:
    1/√head_dim (the 27B: 1/√(d/heads)), not transformers' default query_pre_attn_scalar.
    The norms hold (1 + w) already (the converter adds the 1), as we keep them."""
    window = meta.get("gemma3.attention.sliding_window")
    pattern = meta.get("gemma3.attention.sliding_window_pattern", GEMMA3_WINDOW_PERIOD)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise refuse(f"gemma3.attention.sliding_window_pattern has {len(pattern)} entries "
                         f"for {layers} layers")
        local = [bool(flag) for flag in pattern]
    else:
        period = int(pattern)
        local = [period == 0 or i % period < period - 1 for i in range(layers)]
    return {"hidden_activation": "gelu_pytorch_tanh",
            "sliding_window": int(window) if window else None,
            "layer_types": ["sliding_attention" if window and flag else "full_attention"
                            for flag in local],
            "query_pre_attn_scalar": d // heads if layers == GEMMA3_27B_LAYERS else head_dim,
            "rope_local_base_freq": float(meta.get("gemma3.rope.freq_base_swa",
                                                   GEMMA3_LOCAL_THETA)),
            "final_logit_softcapping": meta.get("gemma3.final_logit_softcapping")}


def _longrope(hf: dict[str, Any]) -> bool:
    scaling = hf.get("rope_scaling") or {}
    return str(scaling.get("rope_type", scaling.get("type"))) in ("longrope", "su")


def _context(hf: dict[str, Any], default: int) -> int:
    """max_position_embeddings, or a LongRoPE model's pretrained length: past it
    transformers switches to the long factors, which static rotary tables cannot follow."""
    if _longrope(hf) and hf.get("original_max_position_embeddings"):
        return int(hf["original_max_position_embeddings"])
    return int(hf.get("max_position_embeddings", default))


def _scaling(hf: dict[str, Any]) -> dict[str, Any] | None:
    """rope_scaling as transformers applies it; for LongRoPE with the attention factor it
    computes from the configured and pretrained lengths (transformers'
    _compute_longrope_parameters) written in, so the checkpoint states it."""
    scaling = dict(hf["rope_scaling"]) if hf.get("rope_scaling") else None
    if scaling is None or not _longrope(hf):
        return scaling
    scaling["rope_type"] = "longrope"
    scaling.pop("type", None)
    if scaling.get("attention_factor") is None:
        length = int(hf.get("max_position_embeddings", 4096))
        pretrained = int(hf.get("original_max_position_embeddings") or length)
        factor = length / pretrained
        scaling["attention_factor"] = (1.0 if factor <= 1.0 else math.sqrt(
            1 + math.log(factor) / math.log(pretrained)))
    return scaling


def _sliding_window(hf: dict[str, Any], model_type: str) -> int | None:
    """Mistral's window (a Llama GGUF file may carry one too), None where it covers the
    whole context (Mistral 7B v0.2 and later write null)."""
    window = hf.get("sliding_window") if model_type in ("mistral", "llama", "phi3") else None
    # llama.cpp's converter writes 0 for none (Phi-4)
    if not window or int(window) >= int(hf.get("max_position_embeddings", 1 << 30)):
        return None
    return int(window)


def _nope_layers(hf: dict[str, Any], n_layers: int, refuse: Refuse) -> tuple[int, ...]:
    """SmolLM3's layers without rotary, from ``no_rope_layers`` (1: rotary, per layer) or,
    absent, every ``no_rope_layer_interval``-th layer, as transformers derives it."""
    flags = hf.get("no_rope_layers")
    if flags is None:
        step = int(hf.get("no_rope_layer_interval", SMOLLM3_NOPE_STEP))
        flags = [int((i + 1) % step != 0) for i in range(n_layers)]
    if len(flags) != n_layers:
        raise refuse(f"no_rope_layers has {len(flags)} entries for {n_layers} layers")
    return tuple(i for i, rotary in enumerate(flags) if not rotary)


def _phi3_longrope(meta: dict[str, Any], tensors: Mapping[str, gguf.ReaderTensor],
                   refuse: Refuse, dequantize: Callable[[gguf.ReaderTensor], Tensor]
                   ) -> dict[str, Any]:
    """transformers' LongRoPE scaling from a phi3 file's factor tensors and the attention
    factor the converter computed (``rope.scaling.attn_factor``); served with the short
    factors, up to ``rope.scaling.original_context_length`` (model/rotary.py)."""
    missing = [t for t in PHI3_ROPE_FACTORS if t not in tensors]
    if missing:
        raise refuse(f"LongRoPE needs both factor tensors; {missing} is missing")
    long, short = (dequantize(tensors[t]).tolist() for t in PHI3_ROPE_FACTORS)
    factor = meta.get("phi3.rope.scaling.attn_factor")
    return {"rope_type": "longrope", "long_factor": long, "short_factor": short,
            "attention_factor": None if factor is None else float(factor)}


def _rope_scaling(meta: dict[str, Any], family: str, tensors: Mapping[str, gguf.ReaderTensor],
                  head_dim: int, theta: float, refuse: Refuse,
                  dequantize: Callable[[gguf.ReaderTensor], Tensor]) -> dict[str, Any] | None:
    """transformers' rope_scaling for the file's scaling keys or Llama 3's rope_freqs."""
    kind = meta.get(f"{family}.rope.scaling.type", "none")
    factor = float(meta.get(f"{family}.rope.scaling.factor",
                            meta.get(f"{family}.rope.scale_linear", 1.0)))
    scaling: dict[str, Any] | None = None
    if kind == "linear" or (kind == "none" and factor != 1.0):
        scaling = {"rope_type": "linear", "factor": factor}
    elif kind != "none":
        raise refuse(f"{family}.rope.scaling.type {kind!r} is not supported (only linear, "
                     "and Llama 3's rope_freqs)")
    if ROPE_FREQS not in tensors:
        return scaling
    if scaling is not None:
        raise refuse(f"{ROPE_FREQS} together with {kind} scaling is not supported")
    # llama.cpp divides each frequency by its factor: 1 (short wavelengths) .. `factor`.
    factors = dequantize(tensors[ROPE_FREQS])  # (hs/2,)
    base = inverse_frequencies(head_dim, theta)  # (hs/2,)
    if factors.shape != base.shape:
        raise refuse(f"{ROPE_FREQS} has {factors.numel()} factors, head_dim {head_dim} needs "
                     f"{base.numel()}")
    if torch.all(factors == 1):
        return None
    llama3 = {"rope_type": "llama3", "factor": float(factors.max()), **LLAMA3_SCALING}
    if not torch.allclose(inverse_frequencies(head_dim, theta, llama3), base / factors,
                          rtol=1e-5, atol=0):
        raise refuse(f"{ROPE_FREQS} holds rotary factors that are not Llama 3's scaling "
                     f"({llama3}); not supported")
    return llama3


ARCHITECTURE = Llama()
