"""Hugging Face LlamaForCausalLM / Qwen2ForCausalLM → our GPTConfig and tensor names.

model/hf_import.py dispatches here on ``model_type`` (``llama`` or ``qwen2``): SmolLM2,
TinyLlama and the Llama 3 family are ``llama``, Qwen2 and Qwen2.5 are ``qwen2``. The
conversion is a renaming — transformers' Linear weights are already (out, in) and its
rotary layout is ours — so it is exact. Options that change what the network computes
and that our model does not have (sliding-window attention, other activations, partial
rotary, a head_dim that is not hidden/heads, rope scalings other than linear and llama3)
are refused with one line.
"""

from __future__ import annotations

from typing import Any

from model.config import GPTConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Buffers some checkpoints saved with the weights; not weights.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
PREFIX = "model."


def llama_config_from_hf(hf: dict[str, Any], refuse: Any) -> GPTConfig:
    """GPTConfig computing what LlamaForCausalLM / Qwen2ForCausalLM compute, or
    ``raise refuse(reason)``."""
    model_type = str(hf.get("model_type"))
    architecture = ARCHITECTURES[model_type]
    architectures = hf.get("architectures") or [architecture]
    if architectures != [architecture]:
        raise refuse(f"architectures {architectures} are not supported for model_type "
                     f"{model_type!r}; only {architecture} (a causal language model) is")
    if hf.get("quantization_config"):
        raise refuse("quantized checkpoints (quantization_config) are not supported; "
                     "import the float weights")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise refuse(f"hidden_act {act!r} is not supported (only silu: SwiGLU)")
    if model_type == "qwen2" and hf.get("use_sliding_window", False):
        raise refuse("use_sliding_window=true is not supported (full attention only)")
    if float(hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise refuse(f"partial_rotary_factor {hf['partial_rotary_factor']} is not supported "
                     "(rotary over the whole head only)")
    try:
        d_model = int(hf.get("hidden_size", 4096))
        n_heads = int(hf.get("num_attention_heads", 32))
        head_dim = hf.get("head_dim")
        if head_dim is not None and int(head_dim) * n_heads != d_model:
            raise refuse(f"head_dim {head_dim} × {n_heads} heads ≠ hidden_size {d_model} "
                         "is not supported")
        n_kv = hf.get("num_key_value_heads")
        bias = bool(hf.get("attention_bias", False)) if model_type == "llama" else False
        return GPTConfig(
            vocab_size=int(hf.get("vocab_size", 32000 if model_type == "llama" else 151936)),
            d_model=d_model,
            n_heads=n_heads,
            n_layers=int(hf.get("num_hidden_layers", 32)),
            d_ff=int(hf.get("intermediate_size", 11008)),
            max_seq_len=int(hf.get("max_position_embeddings",
                                   2048 if model_type == "llama" else 32768)),
            position="rope",
            activation="silu",
            tie_weights=bool(hf.get("tie_word_embeddings", False)),
            layer_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            attn_bias=bias,
            arch="llama",
            n_kv_heads=int(n_kv) if n_kv is not None else None,
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            rope_scaling=dict(hf["rope_scaling"]) if hf.get("rope_scaling") else None,
            qkv_bias=model_type == "qwen2",
            mlp_bias=bool(hf.get("mlp_bias", False)) if model_type == "llama" else False,
        )
    except (TypeError, ValueError) as exc:
        raise refuse(f"unsupported configuration: {exc}") from exc


def llama_expected_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The model's tensors (with the ``model.`` prefix, without lm_head) and their shapes."""
    d, f, v = config.d_model, config.d_ff, config.vocab_size
    kv = config.kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d),
                                          "model.norm.weight": (d,)}
    qkv_bias = config.qkv_bias or config.attn_bias
    for i in range(config.n_layers):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.input_layernorm.weight": (d,), f"{p}.post_attention_layernorm.weight": (d,),
            f"{p}.self_attn.q_proj.weight": (d, d), f"{p}.self_attn.k_proj.weight": (kv, d),
            f"{p}.self_attn.v_proj.weight": (kv, d), f"{p}.self_attn.o_proj.weight": (d, d),
            f"{p}.mlp.gate_proj.weight": (f, d), f"{p}.mlp.up_proj.weight": (f, d),
            f"{p}.mlp.down_proj.weight": (d, f),
        })
        if qkv_bias:
            shapes.update({f"{p}.self_attn.q_proj.bias": (d,),
                           f"{p}.self_attn.k_proj.bias": (kv,),
                           f"{p}.self_attn.v_proj.bias": (kv,)})
        if config.attn_bias:
            shapes[f"{p}.self_attn.o_proj.bias"] = (d,)
        if config.mlp_bias:
            shapes.update({f"{p}.mlp.gate_proj.bias": (f,), f"{p}.mlp.up_proj.bias": (f,),
                           f"{p}.mlp.down_proj.bias": (d,)})
    return shapes


RENAMES = (("self_attn.q_proj", "attn.w_q"), ("self_attn.k_proj", "attn.w_k"),
           ("self_attn.v_proj", "attn.w_v"), ("self_attn.o_proj", "attn.w_o"),
           ("mlp.gate_proj", "ffn.gate"), ("mlp.up_proj", "ffn.up"),
           ("mlp.down_proj", "ffn.down"), ("input_layernorm", "ln_1"),
           ("post_attention_layernorm", "ln_2"))


def llama_state_dict(raw: dict[str, Any], config: GPTConfig) -> dict[str, Any]:
    """HF names (``model.`` prefix included) → model.gpt.GPT's names; same layouts."""
    out: dict[str, Any] = {"tok_emb.weight": raw["model.embed_tokens.weight"],  # (V, d)
                           "ln_f.weight": raw["model.norm.weight"]}  # (d,)
    for name, tensor in raw.items():
        if not name.startswith("model.layers."):
            continue
        rest = name.removeprefix("model.layers.")
        index, _, tail = rest.partition(".")
        for theirs, ours in RENAMES:
            if tail.startswith(theirs + "."):
                out[f"blocks.{index}.{ours}{tail.removeprefix(theirs)}"] = tensor
                break
    # Tied: the head is the embedding whatever lm_head.weight a file may also hold.
    out["lm_head.weight"] = (raw["model.embed_tokens.weight"] if config.tie_weights
                             else raw["lm_head.weight"])
    return out


def hf_llama_config(config: GPTConfig, special: dict[str, Any]) -> dict[str, Any]:
    """The LlamaConfig (or Qwen2Config, for Q/K/V biases alone) computing what ``config``
    computes: the inverse of :func:`llama_config_from_hf`."""
    qwen2 = config.qkv_bias and not config.attn_bias
    if qwen2 and config.mlp_bias:
        raise ValueError("Q/K/V biases with SwiGLU biases have no transformers equivalent "
                         "(Qwen2 has no mlp_bias, Llama biases all four attention projections)")
    values: dict[str, Any] = {
        "architectures": [ARCHITECTURES["qwen2" if qwen2 else "llama"]],
        "model_type": "qwen2" if qwen2 else "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.d_model,
        "intermediate_size": config.d_ff, "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads, "num_key_value_heads": config.kv_heads,
        "max_position_embeddings": config.max_seq_len, "rms_norm_eps": config.layer_norm_eps,
        "rope_theta": config.rope_theta, "rope_scaling": config.rope_scaling,
        "hidden_act": "silu", "tie_word_embeddings": config.tie_weights,
        "attention_dropout": 0.0, "use_cache": True, "torch_dtype": "float32",
        "bos_token_id": special.get("bos_token_id"), "eos_token_id": special.get("eos_token_id"),
        "pad_token_id": special.get("pad_token_id"),
    }
    if qwen2:
        values.update(use_sliding_window=False, sliding_window=None,
                      max_window_layers=config.n_layers)
    else:
        values.update(head_dim=config.head_dim, attention_bias=config.attn_bias,
                      mlp_bias=config.mlp_bias, pretraining_tp=1)
    return values


def hf_llama_state_dict(state: dict[str, Any], config: GPTConfig) -> dict[str, Any]:
    """model.gpt.GPT's tensors → transformers' names (the inverse of llama_state_dict)."""
    out: dict[str, Any] = {"model.embed_tokens.weight": state["tok_emb.weight"],
                           "model.norm.weight": state["ln_f.weight"]}
    for name, tensor in state.items():
        if not name.startswith("blocks."):
            continue
        index, _, tail = name.removeprefix("blocks.").partition(".")
        for theirs, ours in RENAMES:
            if tail.startswith(ours + "."):
                out[f"model.layers.{index}.{theirs}{tail.removeprefix(ours)}"] = tensor
                break
        else:
            raise ValueError(f"no transformers name for {name}")
    if not config.tie_weights:
        out["lm_head.weight"] = state["lm_head.weight"]
    return out
