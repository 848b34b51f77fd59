"""A Hugging Face-style config.json checked into our GPTConfig, and the refusal every import
raises: below the importers and model/gguf_weights.py, which a checkpoint's loading uses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from model.architectures import for_hf_model_type, hf_model_types
from model.config import GPTConfig


class ImportRefused(ValueError):
    """The directory is not something this importer converts faithfully (one-line reason)."""


def gpt_config_from_hf(hf: dict[str, Any], where: Path) -> GPTConfig:
    """GPTConfig computing exactly what transformers computes for ``hf``, or a refusal."""

    def refuse(reason: str) -> ImportRefused:
        return ImportRefused(f"{where}: {reason}")

    model_type = hf.get("model_type")
    arch = for_hf_model_type(str(model_type))
    if arch is None:
        raise refuse(f"model_type {model_type!r} is not supported; attnserve imports "
                     f"model_type {', '.join(hf_model_types())}")
    config: GPTConfig = arch.config_from_hf(hf, refuse)
    return config
