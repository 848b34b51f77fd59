"""manifest.json: what an artifact contains, where it came from, and how it was verified.

The service calls :func:`verify_manifest` at start, so this module imports neither torch
nor onnxruntime. Every file of the artifact is listed with its sha256 and size; a missing,
truncated or tampered file is refused with a :class:`ManifestError` naming it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from service.contract import io_spec as io

MANIFEST_VERSION = 1
REQUIRED_FILES = (io.MODEL_FILE, io.ATTENTION_FILE, io.TOKENIZER_FILE, io.CONFIG_FILE)
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json")
HELD_GGUF_FILE = "model.gguf"  # an imported GGUF file held as the weights (model/checkpoint.py)
_CHUNK = 1 << 20


class ManifestError(ValueError):
    """An artifact's manifest is missing or corrupt, or a file does not match it."""


def sha256_file(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    size: int


def describe_files(directory: Path, names: list[str] | tuple[str, ...]) -> dict[str, FileEntry]:
    return {n: FileEntry(sha256_file(directory / n), (directory / n).stat().st_size)
            for n in names}


def checkpoint_fingerprint(ckpt_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """sha256 of each checkpoint file, plus one digest over them (``name sha256`` lines)."""
    path = Path(ckpt_dir)
    names: tuple[str, ...] = CHECKPOINT_FILES
    if not (path / "model.safetensors").is_file() and (path / HELD_GGUF_FILE).is_file():
        names = tuple(HELD_GGUF_FILE if n == "model.safetensors" else n for n in names)
    files = {n: asdict(e) for n, e in describe_files(path, names).items()}
    lines = "".join(f"{n} {files[n]['sha256']}\n" for n in names)
    return {"path": str(path.resolve()),
            "sha256": hashlib.sha256(lines.encode()).hexdigest(),
            "files": files}


@dataclass
class Manifest:
    """The parsed manifest.json; unknown keys are refused so a typo cannot hide a field."""

    files: dict[str, FileEntry]
    source_checkpoint: dict[str, Any]
    exporter: dict[str, Any]  # name, method, library versions
    opset: int
    kv_dtype: io.KvDtype
    quantization: str | None  # None, "int8"/"int4" (MatMulNBits) or "int8-dynamic"
    io: dict[str, Any]  # {"model": {"inputs": {...}, "outputs": {...}}, "attention": {...}}
    verification: dict[str, Any]
    optimization: dict[str, Any] = field(default_factory=dict)
    # which decoder graph runs which pass (service/contract/graphs.py); [] in manifests
    # written before it, whose table is read from their files
    graphs: list[dict[str, Any]] = field(default_factory=list)
    created_at: str = ""
    manifest_version: int = MANIFEST_VERSION

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["files"] = {n: asdict(e) for n, e in sorted(self.files.items())}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ManifestError(f"unknown manifest keys: {unknown}")
        if data.get("manifest_version") != MANIFEST_VERSION:
            raise ManifestError(
                f"unsupported manifest_version {data.get('manifest_version')!r}")
        values = dict(data)
        values["files"] = {n: FileEntry(str(e["sha256"]), int(e["size"]))
                           for n, e in data["files"].items()}
        return cls(**values)

    def write(self, artifact_dir: str | os.PathLike[str]) -> Path:
        """Write manifest.json atomically (temp file, then rename)."""
        path = Path(artifact_dir) / io.MANIFEST_FILE
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n", "utf-8")
        os.replace(tmp, path)
        return path


def load_manifest(artifact_dir: str | os.PathLike[str]) -> Manifest:
    path = Path(artifact_dir) / io.MANIFEST_FILE
    if not path.is_file():
        raise ManifestError(f"{path} is missing: not an attnserve artifact directory")
    try:
        return Manifest.from_dict(json.loads(path.read_text("utf-8")))
    except ManifestError as exc:
        raise ManifestError(f"{path}: {exc}") from exc
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ManifestError(f"{path} is corrupt: {exc!r}") from exc


def verify_manifest(artifact_dir: str | os.PathLike[str]) -> Manifest:
    """Load manifest.json and check every listed file's size and sha256; return the manifest."""
    root = Path(artifact_dir)
    if not root.is_dir():
        raise ManifestError(f"artifact directory {root} does not exist")
    manifest = load_manifest(root)
    unlisted = [n for n in REQUIRED_FILES if n not in manifest.files]
    if unlisted:
        raise ManifestError(f"{root / io.MANIFEST_FILE} does not list {', '.join(unlisted)}")
    for name, entry in sorted(manifest.files.items()):
        path = root / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ManifestError(f"manifest lists a path outside the artifact: {name!r}")
        if not path.is_file():
            raise ManifestError(f"artifact file {path} is missing")
        size = path.stat().st_size
        if size != entry.size:
            raise ManifestError(
                f"artifact file {path} has {size} bytes, manifest says {entry.size} "
                "(truncated or replaced)")
        if sha256_file(path) != entry.sha256:
            raise ManifestError(f"artifact file {path} does not match its sha256 in the "
                                "manifest (modified after export)")
    return manifest
