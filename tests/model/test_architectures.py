"""The architecture registry and the per-family weight tables, against independent references.

The GGUF tables are checked against gguf-py's own tensor-name map (what llama.cpp's
converter writes), the Q/K layout against the converter's permutation
(tests/gguf_files.py), and the HF tables both ways against transformers' own models.
"""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
import pytest
import torch

from model.architectures import (
    UnknownArchitecture,
    architecture,
    architecture_names,
    for_gguf,
    for_hf_model_type,
)
from model.config import GPTConfig, config_from_preset
from model.gpt import GPT
from tests.gguf_files import llamacpp_permute


def test_lookups_by_name_model_type_and_gguf_architecture() -> None:
    assert architecture_names()[:2] == ("gpt", "llama")
    assert for_hf_model_type("gpt2") is architecture("gpt")
    assert for_hf_model_type("qwen2") is for_hf_model_type("llama") is architecture("llama")
    assert for_gguf("gpt2") is architecture("gpt") and for_gguf("qwen2") is architecture("llama")
    assert for_hf_model_type("qwen3") is for_gguf("qwen3") is architecture("llama")
    assert for_hf_model_type("smollm3") is for_gguf("smollm3") is architecture("llama")
    assert for_hf_model_type("mistral") is architecture("llama")
    assert for_hf_model_type("phi3") is architecture("llama")
    assert for_hf_model_type("gemma3_text") is architecture("llama")
    # a multimodal Gemma 3 config is read through its text_config (model/hf_config.py)
    assert for_hf_model_type("gemma3") is None and for_gguf("gemma3") is architecture("llama")
    with pytest.raises(UnknownArchitecture, match=r"'rwkv'; registered: gpt, llama"):
        GPTConfig(vocab_size=8, arch="rwkv")


@pytest.mark.parametrize(("family", "arch", "preset"), [
    ("gpt2", gguf.MODEL_ARCH.GPT2, "tiny"), ("llama", gguf.MODEL_ARCH.LLAMA, "llama-tiny"),
    ("qwen2", gguf.MODEL_ARCH.QWEN2, "llama-tiny"),
    ("qwen3", gguf.MODEL_ARCH.QWEN3, "llama-tiny"),
    ("smollm3", gguf.MODEL_ARCH.SMOLLM3, "llama-tiny")])
def test_gguf_names_cover_every_parameter_as_llamacpp_names_them(
        family: str, arch: gguf.MODEL_ARCH, preset: str) -> None:
    """Every one of our parameters is filled from exactly the GGUF tensor gguf-py names
    for it (tied heads aside); GPT-2's attn_qkv fills Q, K and V."""
    config = config_from_preset(preset, tie_weights=False,
                                **({"attn_bias": True} if family == "gpt2" else {}))
    if family == "qwen2":
        config = GPTConfig(**(config.to_dict() | {"qkv_bias": True}))
    if family == "qwen3":  # per-head query/key norms, heads twice d / n_heads
        config = GPTConfig(**(config.to_dict() | {"qk_norm": True,
                                                   "head_size": 2 * config.head_dim}))
    ours = set(GPT(config).state_dict())
    table = for_gguf(family)
    assert table is not None
    filled: dict[str, list[str]] = {}
    for kind in gguf.MODEL_TENSORS[arch]:  # every tensor llama.cpp defines for the family
        for i in range(config.n_layers):
            for suffix in ("weight", "bias"):
                name = f"{gguf.TENSOR_NAMES[kind].format(bid=i)}.{suffix}"
                for target in table.gguf_targets(name) or []:
                    if target in ours:
                        filled.setdefault(target, []).append(name)
    assert set(filled) == ours
    assert all(len(set(sources)) == 1 for sources in filled.values())
    # gguf-py's own map from transformers' names agrees on a projection
    hf_q = "h.0.attn.c_attn" if family == "gpt2" else "model.layers.0.self_attn.q_proj"
    expected = gguf.get_tensor_name_map(arch, config.n_layers).get_name(hf_q)
    assert filled["blocks.0.attn.w_q.weight"] == [f"{expected}.weight"]


def test_llama_gguf_layout_undoes_llamacpps_permutation() -> None:
    llama = architecture("llama")
    config = config_from_preset("llama-tiny")  # 4 query heads, 2 key/value heads
    rng = np.random.default_rng(0)
    q = rng.standard_normal((config.d_model, config.d_model)).astype(np.float32)
    k = rng.standard_normal((config.kv_heads * config.head_dim, config.d_model)).astype(
        np.float32)
    q_gguf = torch.from_numpy(llamacpp_permute(q, config.n_heads))
    k_gguf = torch.from_numpy(llamacpp_permute(k, config.n_heads, config.kv_heads))
    assert not torch.equal(q_gguf, torch.from_numpy(q))
    assert torch.equal(llama.from_gguf_layout(q_gguf, "blocks.0.attn.w_q.weight", "llama",
                                              config), torch.from_numpy(q))
    assert torch.equal(llama.from_gguf_layout(k_gguf, "blocks.1.attn.w_k.weight", "llama",
                                              config), torch.from_numpy(k))
    # qwen2 files keep transformers' layout; other tensors are never touched
    assert llama.from_gguf_layout(q_gguf, "blocks.0.attn.w_q.weight", "qwen2",
                                  config) is q_gguf
    assert llama.from_gguf_layout(q_gguf, "blocks.0.attn.w_v.weight", "llama",
                                  config) is q_gguf


@torch.no_grad()
@pytest.mark.parametrize("family", ["gpt", "llama", "qwen3"])
def test_hf_names_round_trip_through_transformers(family: str) -> None:
    """ours → HF names/layouts → transformers loads them strictly → back to ours, exact."""
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = architecture("gpt" if family == "gpt" else "llama")
    preset = "tiny" if family == "gpt" else "llama-tiny"
    config = config_from_preset(preset, vocab_size=64,
                                **({"attn_bias": True, "activation": "gelu_tanh"}
                                   if family == "gpt" else {}))
    if family == "qwen3":
        config = GPTConfig(**(config.to_dict() | {"qk_norm": True,
                                                   "head_size": 2 * config.head_dim}))
    torch.manual_seed(0)
    model = GPT(config).eval()
    hf_cfg = arch.hf_config(config, {})
    hf_model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(**{k: v for k, v in hf_cfg.items() if k != "architectures"}))
    loaded = hf_model.load_state_dict(arch.state_dict_to_hf(model), strict=False)
    assert loaded.unexpected_keys == []
    assert all(k.endswith(arch.hf_ignored_suffixes) for k in loaded.missing_keys)
    prefix = arch.hf_prefix(list(hf_model.state_dict()))
    raw = {k.removeprefix(prefix): v for k, v in hf_model.state_dict().items()
           if not k.endswith(arch.hf_ignored_suffixes)}
    back = arch.state_dict_from_hf(raw, config)
    for name, tensor in model.state_dict().items():
        assert torch.equal(back[name], tensor), name
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(1))
    assert (hf_model(ids).logits - model(ids).logits).abs().max() <= 1e-5


LLAMA = {"arch": "llama", "position": "rope", "activation": "silu", "vocab_size": 16,
         "d_model": 32, "n_heads": 2, "n_layers": 3, "d_ff": 24}
DESCRIBED = {
    "gpt2": {"vocab_size": 16, "d_model": 32, "n_heads": 2, "n_layers": 2, "d_ff": 24,
             "activation": "gelu_tanh", "attn_bias": True, "tie_weights": True},
    "seeds": {"vocab_size": 16, "d_model": 32, "n_heads": 2, "n_layers": 2, "d_ff": 24,
              "position": "sinusoidal"},
    "qwen2": {**LLAMA, "n_kv_heads": 1, "qkv_bias": True},
    "smollm3": {**LLAMA, "nope_layers": (2,)},
    "mistral": {**LLAMA, "sliding_window": 4},
    "gemma3": {**LLAMA, "activation": "gelu_tanh", "qk_norm": True, "head_size": 32,
               "embed_scale": True, "post_norms": True, "attn_scale": 0.25,
               "sliding_window": 4, "window_layers": (0, 1), "local_rope_theta": 100.0},
    "llama-biased": {**LLAMA, "attn_bias": True, "mlp_bias": True},
}


@pytest.mark.parametrize("name", DESCRIBED)
def test_the_description_says_what_the_torch_modules_compute(name: str) -> None:
    """export/onnx/layers.py writes nodes from the description alone: each of its choices
    must be what the family's torch modules (the reference the export verifies) hold."""
    from model.architectures.llama import RMSNorm

    config = GPTConfig(**DESCRIBED[name])
    gpt: Any = GPT(config)
    form = architecture(config.arch).describe(config)
    block = gpt.blocks[0]
    assert form.norm == ("rms" if isinstance(block.ln_1, RMSNorm) else "layer")
    assert isinstance(block.ln_1, RMSNorm | torch.nn.LayerNorm)
    assert form.mlp == ("gated" if hasattr(block.ffn, "gate") else "plain")
    assert form.mlp_bias == (block.ffn.up.bias is not None)
    assert form.qkv_bias == (block.attn.w_q.bias is not None)
    assert form.out_bias == (block.attn.w_o.bias is not None)
    assert form.qk_norm == (block.attn.q_norm is not None)
    assert form.post_norms == (block.post_attn is not None)
    assert form.rotary == (gpt.rotary is not None)
    assert form.tied_head == (gpt.lm_head.weight is gpt.tok_emb.weight)
    assert form.attention_width == block.attn.w_q.weight.shape[0]
    expected = {"gemma3": [(True, "local"), (True, "local"), (False, "global")],
                "smollm3": [(False, "global"), (False, "global"), (False, None)],
                "mistral": [(True, "global")] * 3}.get(name)
    if expected is not None:
        assert [(layer.windowed, layer.rotary) for layer in form.layers] == expected
    assert form.global_layers == (name != "mistral")
    assert (form.embed_scale is not None) == (name == "gemma3")
