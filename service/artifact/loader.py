"""Opening an artifact directory: verify its manifest, read its config and tokenizer.

Everything here is cheap and runs before the server listens, so a tampered file, a
missing tokenizer or an unavailable device ends the start with one clear message.
The ONNX Runtime sessions are created afterwards, in the app's lifespan.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.artifact.generation_defaults import GenerationDefaults, parse_generation_defaults
from service.artifact.text import TextCodec
from service.contract import io_spec as io
from service.contract.chat_template import ChatTemplate
from service.contract.manifest import verify_manifest
from service.providers import select_providers
from service.settings import Limits, Settings


@dataclass(frozen=True)
class Artifact:
    path: Path
    config: io.ArtifactConfig
    name: str  # served model name
    sha256: str  # of manifest.json, which pins every file's sha256
    files: dict[str, str]  # file name -> sha256, as verified
    codec: TextCodec
    limits: Limits
    providers: list[str]  # what the sessions will ask ONNX Runtime for, in order
    chat_template: ChatTemplate
    extra_eos_ids: tuple[int, ...]  # generation_config.json's eos_token_id beyond config's
    generation_defaults: GenerationDefaults  # its sampling fields, for the OpenAI routes
    # a request's completion length when it names none: config.json's (the export's); None:
    # the contract's (service/http/validation.py's Validator.max_new_tokens weighs them all)
    default_max_new_tokens: int | None


def read_generation_config(path: Path, listed: Mapping[str, object]) -> dict[str, Any]:
    """The artifact's pinned generation_config.json ({} when it has none)."""
    if io.GENERATION_CONFIG_FILE not in listed:
        return {}
    data = json.loads((path / io.GENERATION_CONFIG_FILE).read_text("utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{io.GENERATION_CONFIG_FILE}: expected a JSON object")
    return data


def generation_eos_ids(data: Mapping[str, Any], config: io.ArtifactConfig) -> tuple[int, ...]:
    """End-of-sequence ids a Hugging Face generation_config.json adds (Llama 3 lists
    several: <|eot_id|>, <|end_of_text|>); those outside the vocabulary are refused."""
    value = data.get("eos_token_id")
    ids = [value] if isinstance(value, int) else value if isinstance(value, list) else []
    bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < config.vocab_size]
    if bad:
        raise ValueError(f"{io.GENERATION_CONFIG_FILE}: eos_token_id {bad} outside the "
                         f"vocabulary of {config.vocab_size}")
    return tuple(sorted(set(ids) - {config.eos_token_id}))


def open_artifact(settings: Settings) -> Artifact:
    path = settings.model
    manifest = verify_manifest(path)  # ManifestError (a ValueError) names the bad file
    config = io.ArtifactConfig.load(path)
    codec = TextCodec.from_file(path / io.TOKENIZER_FILE)
    if codec.vocab_size > config.vocab_size:
        raise ValueError(f"tokenizer.json has {codec.vocab_size} tokens but the model only "
                         f"{config.vocab_size}")
    # GPT-2 has no pad token: a template then sees no pad_token variable at all.
    specials = {name: codec.token_text(token_id) for name, token_id in (
        ("bos_token", config.bos_token_id), ("eos_token", config.eos_token_id),
        ("pad_token", config.pad_token_id)) if token_id is not None}
    chat_template = ChatTemplate.load(path, specials, listed=list(manifest.files))
    generation = read_generation_config(path, manifest.files)
    return Artifact(
        path=path, config=config, name=settings.served_model_name or config.model_name,
        sha256=hashlib.sha256((path / io.MANIFEST_FILE).read_bytes()).hexdigest(),
        files={name: entry.sha256 for name, entry in sorted(manifest.files.items())},
        codec=codec, limits=Limits.resolve(settings, config.max_seq_len),
        providers=select_providers(settings.device), chat_template=chat_template,
        extra_eos_ids=generation_eos_ids(generation, config),
        generation_defaults=parse_generation_defaults(generation)
        if settings.generation_config == "auto" else GenerationDefaults(),
        default_max_new_tokens=config.generation.max_new_tokens)
