"""Checkpoint directory: config.json · model.safetensors · tokenizer.json · metrics.jsonl.

No pickle anywhere: weights are safetensors, everything else is JSON. A checkpoint
imported from a GGUF file holds that file (model.gguf) instead of model.safetensors: its
quantised blocks, dequantised when the checkpoint is loaded (model/gguf/reader.py), kept
as they are by ``export --quantize gguf``. A checkpoint is built in a temporary sibling
directory and renamed into place, so an interrupted run never leaves a directory that
looks valid.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.config import GPTConfig
from model.staging import staged_directory

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
GGUF_WEIGHTS_FILE = "model.gguf"  # an imported GGUF file, held as the weights
TOKENIZER_FILE = "tokenizer.json"
METRICS_FILE = "metrics.jsonl"
TRAIN_STATE_FILE = "train_state.safetensors"  # AdamW's moments, for --resume
FINETUNE_RUN_FILE = "finetune.json"  # a fine-tune's options, data hash and step
PICKLE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle", ".bin", ".ckpt")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt or in a refused format."""


@dataclass
class CheckpointMeta:
    """Everything in config.json besides the weights: model dims, tokenizer, training."""

    model: GPTConfig
    tokenizer: dict[str, Any]  # kind, pad/bos/eos token ids
    training: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "model": self.model.to_dict(),
            "tokenizer": self.tokenizer,
            "training": self.training,
        }


def _check_not_pickle(path: Path) -> None:
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise CheckpointError(
            f"{path} looks like a pickled PyTorch file; attnserve loads only checkpoint "
            f"directories with {WEIGHTS_FILE} (safetensors) and refuses pickle")


def read_meta(ckpt_dir: str | os.PathLike[str]) -> CheckpointMeta:
    """Read and validate config.json without loading weights (checking the model config
    imports its architecture's module, and so torch, on first use)."""
    path = Path(ckpt_dir)
    _check_not_pickle(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    missing = [n for n in (CONFIG_FILE, TOKENIZER_FILE) if not (path / n).is_file()]
    if not any((path / n).is_file() for n in (WEIGHTS_FILE, GGUF_WEIGHTS_FILE)):
        missing.insert(1, WEIGHTS_FILE)
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete: missing {', '.join(missing)}")
    try:
        raw = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path / CONFIG_FILE} is corrupt: expected a JSON object, "
                                  f"got {type(raw).__name__}")
        if raw.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{path / CONFIG_FILE}: unsupported format_version {raw.get('format_version')!r}")
        return CheckpointMeta(
            model=GPTConfig.from_dict(raw["model"]),
            tokenizer=dict(raw["tokenizer"]),
            training=dict(raw.get("training", {})),
        )
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path / CONFIG_FILE} is corrupt: {exc}") from exc


def save_checkpoint(
    out_dir: str | os.PathLike[str],
    model: Any,  # model.gpt.GPT; typed loosely so this module imports without torch
    meta: CheckpointMeta,
    tokenizer_json: str,
    metrics: Iterable[dict[str, Any]] = (),
    extra_files: Mapping[str, bytes] | None = None,
    gguf_file: str | os.PathLike[str] | None = None,
) -> Path:
    """Write a complete checkpoint atomically and return its path.

    ``extra_files`` (name → content) travel along, e.g. an imported model's
    generation_config.json and chat template, which `attnserve export` carries on.
    ``gguf_file``: hold that file as the weights (model.gguf; ``model`` is then None): a
    hard link where the filesystem allows (no bytes copied), else a copy.
    """
    from safetensors.torch import save_model

    with staged_directory(out_dir) as tmp:
        for name, content in (extra_files or {}).items():
            if Path(name).name != name or name in (WEIGHTS_FILE, GGUF_WEIGHTS_FILE,
                                                   TOKENIZER_FILE, CONFIG_FILE, METRICS_FILE):
                raise ValueError(f"extra checkpoint file {name!r} is not a plain new name")
            (tmp / name).write_bytes(content)
        if gguf_file is not None:
            try:
                os.link(gguf_file, tmp / GGUF_WEIGHTS_FILE)
            except OSError:  # another filesystem, or links not allowed
                shutil.copyfile(gguf_file, tmp / GGUF_WEIGHTS_FILE)
        else:
            save_model(model, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / TOKENIZER_FILE).write_text(tokenizer_json, encoding="utf-8")
        (tmp / METRICS_FILE).write_text(
            "".join(json.dumps(m) + "\n" for m in metrics), encoding="utf-8")
        (tmp / CONFIG_FILE).write_text(json.dumps(meta.to_json(), indent=2), encoding="utf-8")
    return Path(out_dir)


@dataclass
class Checkpoint:
    model: Any  # model.gpt.GPT
    meta: CheckpointMeta
    path: Path
    # the GGUF file it holds as a source of dequantised weights (model/gguf/reader.py's
    # HeldWeights), for a model loaded with some of them left out; None otherwise
    held: Any = None

    @property
    def tokenizer_path(self) -> Path:
        return self.path / TOKENIZER_FILE


def weights_path(ckpt_dir: str | os.PathLike[str]) -> Path:
    """The checkpoint's weights: model.safetensors, or the GGUF file it holds."""
    path = Path(ckpt_dir)
    held = path / GGUF_WEIGHTS_FILE
    return held if held.is_file() and not (path / WEIGHTS_FILE).is_file() else path / WEIGHTS_FILE


def load_checkpoint(ckpt_dir: str | os.PathLike[str], device: str = "cpu",
                    leave: frozenset[Any] = frozenset()) -> Checkpoint:
    """Rebuild ``GPT(GPTConfig(**config))`` and load its safetensors weights strictly.

    ``leave``: for a checkpoint that holds its GGUF file, the GGUF tensor types whose
    weights stay on the meta device (``export --quantize gguf`` builds those from the
    file's blocks; ``Checkpoint.held`` gives their values on demand)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    from model.gpt import GPT

    meta = read_meta(ckpt_dir)
    path = Path(ckpt_dir)
    if weights_path(path).name == GGUF_WEIGHTS_FILE:
        return _load_held_gguf(path, meta, device, leave)
    model = GPT(meta.model)
    try:
        missing, unexpected = load_model(model, str(path / WEIGHTS_FILE), strict=False,
                                         device=device)
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"{path / WEIGHTS_FILE} is corrupt or does not match "
                              f"config.json: {exc}") from exc
    if missing or unexpected:
        raise CheckpointError(
            f"{path / WEIGHTS_FILE} does not match config.json: missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)}")
    model.to(device).eval()
    return Checkpoint(model=model, meta=meta, path=path)


def _load_held_gguf(path: Path, meta: CheckpointMeta, device: str,
                    leave: frozenset[Any]) -> Checkpoint:
    """A checkpoint holding its GGUF file: the weights dequantised from it, once. Its
    ``imported_from`` record points at the held file (the one ``--quantize gguf`` reads:
    the same bytes as the imported one, which may since have moved)."""
    from model.gguf.reader import HeldWeights
    from model.hf_config import ImportRefused

    try:
        held = HeldWeights(path / GGUF_WEIGHTS_FILE, meta.model)
        model = held.model(leave)
    except ImportRefused as exc:
        raise CheckpointError(f"{path / GGUF_WEIGHTS_FILE} does not match config.json: "
                              f"{exc}") from exc
    record = meta.training.get("imported_from")
    if isinstance(record, dict):
        meta.training["imported_from"] = {**record, "path": str(path / GGUF_WEIGHTS_FILE)}
    if not leave:
        return Checkpoint(model=model.to(device), meta=meta, path=path)
    return Checkpoint(model=model, meta=meta, path=path, held=held)


def carried_files(ckpt_dir: str | os.PathLike[str]) -> dict[str, bytes]:
    """The files a checkpoint holds beside its config, weights, tokenizer and metrics (an
    import's chat template, tokenizer_config.json, generation_config.json): what a
    checkpoint derived from it (a fine-tune, a merge) carries on."""
    own = {CONFIG_FILE, WEIGHTS_FILE, GGUF_WEIGHTS_FILE, TOKENIZER_FILE, METRICS_FILE,
           TRAIN_STATE_FILE, FINETUNE_RUN_FILE}
    return {p.name: p.read_bytes() for p in sorted(Path(ckpt_dir).iterdir())
            if p.is_file() and p.name not in own and not p.name.startswith(".")}


def descends_from_import(training: dict[str, Any]) -> bool:
    """Whether the weights come from an imported model, directly or through fine-tunes and
    merges (``finetuned_from`` / ``merged_from`` keep the base's record): such a model's
    vocabulary may be padded beyond its tokenizer's."""
    record: Any = training
    while isinstance(record, dict):
        if "imported_from" in record:
            return True
        parent = record.get("finetuned_from") or record.get("merged_from")
        record = parent.get("base_training") if isinstance(parent, dict) else None
    return False


def read_metrics(ckpt_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    path = Path(ckpt_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
