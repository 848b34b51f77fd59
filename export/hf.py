"""Write a checkpoint as a Hugging Face transformers GPT-2 model (config.json + safetensors).

Usage (through the export CLI):
    attnserve export --format hf --ckpt checkpoints/default --out hf/default

Our GPT and GPT-2 are the same network once a few choices are spelled out: pre-norm
blocks, a final LayerNorm, learned positions (a sinusoidal table is written into ``wpe``
and reproduces ours exactly), Q/K/V/O with biases (``attn_bias``, as imported GPT-2
models have) or without (GPT-2's attention biases become zeros), a biased feed-forward
layer with ReLU, exact-erf GELU or GPT-2's tanh GELU, and a bias-free head that is tied
or not. A model imported from GPT-2 comes back bit-identical. GPT-2 stores its linear
layers as ``Conv1D`` with (in, out) weights, so every matrix is transposed. The copy
exists so that a benchmark against transformers runs on the very same weights;
transformers itself is not needed to write it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from model.checkpoint import TOKENIZER_FILE, load_checkpoint
from model.config import GPTConfig
from model.staging import staged_directory

HF_CONFIG_FILE = "config.json"
HF_WEIGHTS_FILE = "model.safetensors"
HF_TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
HF_GENERATION_CONFIG_FILE = "generation_config.json"
HF_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new"}


def hf_config(config: GPTConfig, special: dict[str, Any]) -> dict[str, Any]:
    """GPT2Config fields that make transformers compute exactly what model.gpt.GPT computes."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.max_seq_len,
        "n_ctx": config.max_seq_len,
        "n_embd": config.d_model,
        "n_layer": config.n_layers,
        "n_head": config.n_heads,
        "n_inner": config.d_ff,
        # transformers' "gelu" is the exact-erf GELU, like torch.nn.GELU(); GPT-2's own
        # "gelu_new" is the tanh approximation, our gelu_tanh.
        "activation_function": HF_ACTIVATIONS[config.activation],
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "summary_first_dropout": 0.0,
        "layer_norm_epsilon": config.layer_norm_eps,
        "initializer_range": 0.02,
        "scale_attn_weights": True,  # divide by √d_k, as ours does
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": config.tie_weights,
        "use_cache": True,
        "bos_token_id": special.get("bos_token_id"),
        "eos_token_id": special.get("eos_token_id"),
        "pad_token_id": special.get("pad_token_id"),
        "torch_dtype": "float32",
    }


def hf_state_dict(model: Any) -> dict[str, Any]:
    """Our parameter names and layouts → GPT-2's (Conv1D weights are (in, out))."""
    import torch

    config: GPTConfig = model.config
    d = config.d_model
    out: dict[str, torch.Tensor] = {}

    def put(name: str, tensor: torch.Tensor) -> None:
        out[name] = tensor.detach().to(torch.float32).contiguous().clone()

    put("transformer.wte.weight", model.tok_emb.weight)  # (V, d)
    if model.pos_emb is not None:
        put("transformer.wpe.weight", model.pos_emb.weight)  # (L, d)
    else:
        put("transformer.wpe.weight", model.pos_table)  # (L, d): the fixed sinusoid table
    zeros_3d = torch.zeros(3 * d)
    zeros_d = torch.zeros(d)
    biased = config.attn_bias
    for i, block in enumerate(model.blocks):
        p = f"transformer.h.{i}"
        attn = block.attn
        put(f"{p}.ln_1.weight", block.ln_1.weight)
        put(f"{p}.ln_1.bias", block.ln_1.bias)
        qkv = torch.cat([attn.w_q.weight, attn.w_k.weight, attn.w_v.weight], dim=0)  # (3d, d)
        put(f"{p}.attn.c_attn.weight", qkv.t())  # (d, 3d)
        put(f"{p}.attn.c_attn.bias", torch.cat([attn.w_q.bias, attn.w_k.bias, attn.w_v.bias])
            if biased else zeros_3d)  # (3d,)
        put(f"{p}.attn.c_proj.weight", attn.w_o.weight.t())  # (d, d)
        put(f"{p}.attn.c_proj.bias", attn.w_o.bias if biased else zeros_d)
        put(f"{p}.ln_2.weight", block.ln_2.weight)
        put(f"{p}.ln_2.bias", block.ln_2.bias)
        put(f"{p}.mlp.c_fc.weight", block.ffn.up.weight.t())  # (d, d_ff)
        put(f"{p}.mlp.c_fc.bias", block.ffn.up.bias)
        put(f"{p}.mlp.c_proj.weight", block.ffn.down.weight.t())  # (d_ff, d)
        put(f"{p}.mlp.c_proj.bias", block.ffn.down.bias)
    put("transformer.ln_f.weight", model.ln_f.weight)
    put("transformer.ln_f.bias", model.ln_f.bias)
    if not config.tie_weights:
        put("lm_head.weight", model.lm_head.weight)  # (V, d)
    return out


def _tokenizer_config(config: GPTConfig, special: dict[str, Any],
                      tokenizer_path: Path) -> dict[str, Any]:
    """Lets transformers' AutoTokenizer wrap our tokenizer.json as a fast tokenizer.

    The special tokens are named from the checkpoint's ids (``<pad>``/``<start>``/``<end>``
    for ours, ``<|endoftext|>`` for GPT-2); a missing one (GPT-2's pad) stays unset.
    """
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    out: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": config.max_seq_len,
        "clean_up_tokenization_spaces": False,
    }
    for kind in ("pad", "bos", "eos"):
        token_id = special.get(f"{kind}_token_id")
        token = tok.id_to_token(token_id) if token_id is not None else None
        if token is not None:
            out[f"{kind}_token"] = token
    return out


def export_hf(
    ckpt_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], force: bool = False
) -> Path:
    """Write ``ckpt_dir`` as a GPT2LMHeadModel directory at ``out_dir`` and return its path.

    Built in a temporary sibling directory and renamed into place; an existing non-empty
    ``out_dir`` is refused unless ``force``.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"output directory {out} is not empty; pass --force to overwrite")
    ckpt = load_checkpoint(ckpt_dir)
    config: GPTConfig = ckpt.meta.model
    special = {k: ckpt.meta.tokenizer.get(k) for k in
               ("pad_token_id", "bos_token_id", "eos_token_id")}
    tensors = hf_state_dict(ckpt.model)

    with staged_directory(out) as tmp:
        save_file(tensors, str(tmp / HF_WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / HF_CONFIG_FILE).write_text(
            json.dumps(hf_config(config, special), indent=2), encoding="utf-8")
        generation = {k: v for k, v in special.items() if v is not None}
        (tmp / HF_GENERATION_CONFIG_FILE).write_text(
            json.dumps(generation, indent=2), encoding="utf-8")
        shutil.copyfile(ckpt.tokenizer_path, tmp / TOKENIZER_FILE)
        (tmp / HF_TOKENIZER_CONFIG_FILE).write_text(
            json.dumps(_tokenizer_config(config, special, ckpt.tokenizer_path), indent=2),
            encoding="utf-8")
    return out
