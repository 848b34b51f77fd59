"""LoRA adapters on disk in PEFT's format: what PEFT, vLLM, TGI and we all read.

``adapter_config.json`` (PEFT's LoraConfig: peft_type LORA, r, lora_alpha, use_rslora,
target_modules, base_model_name_or_path ...) and ``adapter_model.safetensors`` with one
A and one B per adapted module, keyed by transformers' module names:
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` (r, in) and
``....lora_B.weight`` (out, r). Reading refuses, with one line, what an adapter may hold
that a LoRA merge cannot reproduce exactly: DoRA's magnitudes, ``modules_to_save``, bias
training, embedding or other non-projection targets, shapes of another model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save
from torch import Tensor

from model.finetune.lora import Adapter, LoRA, LoRASettings, targets_of
from service.contract.peft_adapter import (  # noqa: F401  (re-exported: the format's names)
    CONFIG_FILE,
    KEY_PREFIX,
    PICKLED_WEIGHTS,
    UNSUPPORTED,
    WEIGHTS_FILE,
    AdapterConfig,
    AdapterError,
    read_config,
    tensor_key,
    tensor_pairs,
    weights_path,
)


def adapter_files(adapter: Adapter, base_model: str) -> dict[str, bytes]:
    """adapter_config.json and adapter_model.safetensors of ``adapter`` (name → bytes);
    ``base_model``: the path of the checkpoint it was trained over."""
    s = adapter.settings
    targets = list(dict.fromkeys(lora.target.kind for lora in adapter.each()))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": s.rank, "lora_alpha": s.alpha, "lora_dropout": s.dropout,
        "use_rslora": s.rslora, "target_modules": targets, "fan_in_fan_out": any(
            lora.target.conv1d for lora in adapter.each()),
        "bias": "none", "use_dora": False, "modules_to_save": None,
        "init_lora_weights": True, "inference_mode": True, "rank_pattern": {},
        "alpha_pattern": {}, "layers_to_transform": None, "layers_pattern": None,
        "revision": None,
    }
    tensors: dict[str, Tensor] = {}
    for lora in adapter.each():
        key = f"{KEY_PREFIX}{lora.target.module}"
        tensors[f"{key}.lora_A.weight"] = lora.lora_A.detach().float().cpu().contiguous()
        tensors[f"{key}.lora_B.weight"] = lora.lora_B.detach().float().cpu().contiguous()
    return {CONFIG_FILE: (json.dumps(config, indent=2) + "\n").encode(),
            WEIGHTS_FILE: save(tensors, metadata={"format": "pt"})}


def read_adapter(directory: Path, model_config: Any) -> Adapter:
    """The adapter in ``directory`` as an :class:`Adapter` for a model of
    ``model_config`` (GPTConfig), every tensor checked against the model's shapes."""
    config = read_config(directory)
    path = weights_path(directory)
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise AdapterError(f"{path} is not a readable safetensors file: {exc}") from exc
    targets = {t.module: t for t in targets_of(model_config)}
    kinds = ", ".join(sorted({t.kind for t in targets.values()}))
    pairs = tensor_pairs(path, tensors, targets,
                         f"this {model_config.arch} model of {model_config.n_layers} layers "
                         f"(its LoRA targets: {kinds} in model layers)")
    loras = [_lora(path, targets[module], pair, config, model_config)
             for module, pair in sorted(pairs.items(), key=lambda kv: _order(targets, kv[0]))]
    settings = LoRASettings(rank=config.rank, alpha=config.alpha, dropout=0.0,
                            rslora=config.rslora,
                            targets=tuple(dict.fromkeys(lora.target.module.rpartition(".")[2]
                                                        for lora in loras)))
    return Adapter(loras, settings)


def _order(targets: dict[str, Any], module: str) -> int:
    return list(targets).index(module)


def _lora(path: Path, target: Any, pair: tuple[Tensor, Tensor], config: AdapterConfig,
          model_config: Any) -> LoRA:
    """One module's LoRA, its shapes checked against the model's layers."""
    a, b = pair
    widths = _layer_widths(target, model_config)
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise AdapterError(f"{path}: {target.module} has A {list(a.shape)} and B "
                           f"{list(b.shape)}, not (r, in) and (out, r)")
    if (a.shape[1], b.shape[0]) != widths:
        raise AdapterError(f"{path}: {target.module} maps {a.shape[1]} → {b.shape[0]} "
                           f"features; this model's maps {widths[0]} → {widths[1]} (an "
                           "adapter for another base model?)")
    rank = int(a.shape[0])
    lora = LoRA(target, widths[0], widths[1], rank, config.scale(target.module, rank), 0.0)
    with torch.no_grad():
        lora.lora_A.copy_(a.float())
        lora.lora_B.copy_(b.float())
    return lora


def _layer_widths(target: Any, config: Any) -> tuple[int, int]:
    """(in, out) of a LoRA target: its layers' input width and their summed rows."""
    d, f = config.d_model, config.d_ff
    kv, width = config.kv_heads * config.head_dim, config.attention_width
    rows = {"attn.w_q": (d, width), "attn.w_k": (d, kv), "attn.w_v": (d, kv),
            "attn.w_o": (width, d), "ffn.gate": (d, f), "ffn.up": (d, f), "ffn.down": (f, d)}
    parts = [rows[name.split(".", 2)[2]] for name in target.ours]
    return parts[0][0], sum(out for _, out in parts)
