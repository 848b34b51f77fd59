"""A Hugging Face-style config.json checked into our GPTConfig, and the refusal every import
raises: below the importers and model/gguf/reader.py, which a checkpoint's loading uses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from model.architectures import for_hf_model_type, hf_model_types
from model.config import GPTConfig


class ImportRefused(ValueError):
    """The directory is not something this importer converts faithfully (one-line reason)."""


# Multimodal configs whose text model is served alone, its vision tower left out (llama.cpp
# does the same: its converter writes the tower to a separate mmproj file): model_type →
# the text model's model_type and causal-LM class.
TEXT_MODELS = {"gemma3": ("gemma3_text", "Gemma3ForCausalLM")}
# transformers' *ForConditionalGeneration names of the text model's weights (as saved since
# 4.52, and before) → the causal LM's
TEXT_WEIGHT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                        ("language_model.lm_head.", "lm_head."))
# the other towers of those models, whose weights the text model does not read
OTHER_TOWERS = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
                "multi_modal_projector.")


def text_model_config(hf: dict[str, Any], where: Path) -> tuple[dict[str, Any], bool]:
    """``hf`` itself, or a multimodal config's ``text_config`` as the causal LM's config
    (its special ids and word-embedding tie from the outer config where the text config
    leaves them out); and whether the weights are the multimodal model's (renamed by
    :func:`text_weight_name`)."""
    if hf.get("model_type") not in TEXT_MODELS:
        return hf, False
    model_type, architecture = TEXT_MODELS[str(hf["model_type"])]
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ImportRefused(f"{where}: model_type {hf['model_type']!r} without a text_config "
                            "object")
    outer = {key: hf[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id",
                                      "tie_word_embeddings") if key in hf}
    return {**outer, **text, "model_type": model_type, "architectures": [architecture]}, True


def text_weight_name(name: str) -> str | None:
    """A multimodal model's tensor name as its text model's (None: another tower's)."""
    if name.startswith(OTHER_TOWERS):
        return None
    for theirs, ours in TEXT_WEIGHT_PREFIXES:
        if name.startswith(theirs):
            return ours + name.removeprefix(theirs)
    return name


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
