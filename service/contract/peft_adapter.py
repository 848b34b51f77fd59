"""A PEFT LoRA adapter's directory, read without torch: what training, merge, export and
the server all check the same way.

``adapter_config.json`` (PEFT's LoraConfig: peft_type LORA, r, lora_alpha, use_rslora,
target_modules, rank_pattern, alpha_pattern ...) and ``adapter_model.safetensors`` with one
A (r, in) and one B (out, r) per adapted module, keyed by transformers' module names
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``). What an adapter may
hold that s·B·A cannot reproduce exactly (DoRA, ``modules_to_save``, trained biases ...)
is refused with one line naming it. model/finetune/peft_format.py builds PyTorch modules
from these; service/engine/adapters.py numpy arrays for the adapter graphs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Container, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")  # a tensor: numpy's for the server, torch's for the fine-tuner

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."
PICKLED_WEIGHTS = "adapter_model.bin"
# LoraConfig fields whose non-default values change what the adapter computes beyond
# s·B·A (or add trained tensors besides A and B): refused, each with its reason.
UNSUPPORTED = {
    "use_dora": "DoRA (weight-decomposed LoRA) is not supported",
    "modules_to_save": "modules_to_save (fully trained copies of modules) is not supported",
    "lora_bias": "trained LoRA biases (lora_bias) are not supported",
    "trainable_token_indices": "trainable token embeddings are not supported",
    "use_qalora": "QA-LoRA (pooled inputs) is not supported",
    "alora_invocation_tokens": "activated LoRA (aLoRA) is not supported",
    "target_parameters": "LoRA on parameters (target_parameters) is not supported",
    "layer_replication": "layer replication is not supported",
}


class AdapterError(ValueError):
    """An adapter directory that is missing, malformed, or not one we can apply exactly."""



@dataclass(frozen=True)
class AdapterConfig:
    """What of adapter_config.json decides the computation."""

    rank: int
    alpha: float
    rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    dropout: float
    base_model: str | None

    def scale(self, module: str, rank: int) -> float:
        """PEFT's scaling of one module: its alpha_pattern's alpha (the first pattern
        matching the module name's tail, as PEFT's get_pattern_key), over r or √r."""
        alpha = next((float(a) for pattern, a in self.alpha_pattern.items()
                      if re.match(rf"(.*\.)?({pattern})$", module)), self.alpha)
        return alpha / (rank ** 0.5 if self.rslora else rank)


def read_config(directory: Path) -> AdapterConfig:
    """adapter_config.json, checked; AdapterError with one line otherwise."""
    path = directory / CONFIG_FILE
    if not directory.is_dir():
        raise AdapterError(f"adapter directory {directory} does not exist")
    if not path.is_file():
        raise AdapterError(f"{directory} is not a PEFT adapter: {CONFIG_FILE} is missing")
    try:
        raw = json.loads(path.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise AdapterError(f"{path}: expected a JSON object")
    if raw.get("peft_type") != "LORA":
        raise AdapterError(f"{path}: peft_type {raw.get('peft_type')!r}; only LORA adapters "
                           "are supported")
    for field, reason in UNSUPPORTED.items():
        if raw.get(field) not in (None, False, [], {}, ""):
            raise AdapterError(f"{path}: {reason} ({field} = {raw[field]!r})")
    if raw.get("bias", "none") != "none":
        raise AdapterError(f"{path}: bias {raw['bias']!r}: trained biases are not supported "
                           "(bias must be 'none')")
    try:
        config = AdapterConfig(
            rank=int(raw.get("r", 8)), alpha=float(raw.get("lora_alpha", 8)),
            rslora=bool(raw.get("use_rslora", False)),
            rank_pattern={str(k): int(v) for k, v in (raw.get("rank_pattern") or {}).items()},
            alpha_pattern={str(k): float(v)
                           for k, v in (raw.get("alpha_pattern") or {}).items()},
            dropout=float(raw.get("lora_dropout", 0.0)),
            base_model=raw.get("base_model_name_or_path"))
    except (TypeError, ValueError, AttributeError) as exc:
        raise AdapterError(f"{path}: malformed LoRA settings: {exc}") from exc
    if config.rank <= 0:
        raise AdapterError(f"{path}: r must be positive, got {config.rank}")
    return config


def weights_path(directory: Path) -> Path:
    """The adapter's adapter_model.safetensors; AdapterError where there is none."""
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        hint = (f" ({PICKLED_WEIGHTS} is pickle, which attnserve does not load; save with "
                "safe_serialization=True)") if (directory / PICKLED_WEIGHTS).is_file() else ""
        raise AdapterError(f"{directory}: {WEIGHTS_FILE} is missing{hint}")
    return path


def tensor_pairs(path: Path, tensors: Mapping[str, T], modules: Container[str],
                 model: str) -> dict[str, tuple[T, T]]:
    """module → (A, B) of an adapter's safetensors ``tensors`` (read from ``path``), each
    module one of ``modules``; AdapterError with one line for a tensor that is not a LoRA A
    or B, a module the model (``model``, for the message) lacks, an A without its B, or no
    tensor at all. Shapes are the caller's to check."""
    pairs: dict[str, dict[str, T]] = {}
    for key, tensor in tensors.items():
        parsed = tensor_key(key)
        if parsed is None:
            raise AdapterError(f"{path}: tensor {key} is not a LoRA A or B of a module "
                               "(DoRA magnitudes, embeddings and biases are not supported)")
        module, part = parsed
        if module not in modules:
            raise AdapterError(f"{path}: {key} adapts {module}, which {model} does not have "
                               "(an adapter for another base model?)")
        pairs.setdefault(module, {})[part] = tensor
    if not pairs:
        raise AdapterError(f"{path} holds no LoRA tensors")
    for module, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterError(f"{path}: {module} has {sorted(pair)} but not both lora_A "
                               "and lora_B")
    return {module: (pair["lora_A"], pair["lora_B"]) for module, pair in pairs.items()}


def tensor_key(key: str) -> tuple[str, str] | None:
    """(module, "lora_A" or "lora_B") of a safetensors key of an adapter; None for a key
    that is neither (DoRA magnitudes, embeddings, biases)."""
    match = _KEY.fullmatch(key)
    return None if match is None else (match.group(1), match.group(2))


_KEY = re.compile(rf"{re.escape(KEY_PREFIX)}(.+)\.(lora_A|lora_B)(?:\.\w+)?\.weight")
