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


@dataclass(frozen=True)
class PassThresholds:
    """From what size a pass runs on one of an artifact's opt-in graphs instead of the
    served one (0: never). Export measured them (:data:`MEASURED_THRESHOLDS`) and records
    those of the graphs it wrote in the manifest's ``exporter``; the engine reads them
    back with :meth:`of`. The one place these numbers live."""

    float32_pass_tokens: int = 0  # passes of at least this many tokens: engine_float32.onnx
    codes8_pass_rows: int = 0  # passes of at least this many rows: the 8-bit codes' graph
    codes8_prompt_tokens: int = 0  # ... or of this many tokens (0: the rows alone decide)

    def held(self, float32_twin: bool, codes8: bool) -> PassThresholds:
        """These thresholds for the opt-in graphs an artifact holds (0 for the others)."""
        return PassThresholds(self.float32_pass_tokens if float32_twin else 0,
                              self.codes8_pass_rows if codes8 else 0,
                              self.codes8_prompt_tokens if codes8 else 0)

    def recorded(self) -> dict[str, int]:
        """The manifest's ``exporter`` entries: the thresholds of the graphs written."""
        return {name: value for name, value in asdict(self).items() if value}

    @classmethod
    def of(cls, manifest: Manifest) -> PassThresholds:
        """An artifact's thresholds: as recorded; where a manifest written before they were
        recorded is silent, what export measures for its quantisation."""
        measured = MEASURED_THRESHOLDS.get(str(manifest.quantization), cls())
        return cls(**{f.name: int(manifest.exporter.get(f.name, getattr(measured, f.name)))
                      for f in fields(cls)})


# Measured per quantisation (SmolLM2, 2 threads). The float32 twin: from how many tokens a
# pass runs faster on it than on MatMulNBits (`python -m benchmarks.float32_twin
# --passes`): 4-bit from about 200 (a 2,048-token pass 20-29 % faster), 8-bit from about
# 1,000 (5 %; 27 % slower at 128); int4's 8-bit codes hold out longer: one prefill pass of
# 256 / 512 / 2,048 tokens took 289 / 546 / 2,188 ms on them, 306 / 525 / 2,003 on the twin;
# gguf's (Q4_1, with its minimums) 366 / 666 / 2,569 against 319 / 545 / 2,005. The 8-bit
# codes of a 4-bit graph (export/widen_codes.py; `python -m benchmarks.quant_blocks
# --engine ...`): from how many rows a decode step is faster on them (4-bit 28.9 / 36.0 /
# 50.2 ms at 12 / 16 / 24 rows, 8-bit codes 29.0 / 35.6 / 47.4), and from how many tokens
# a pass of fewer rows is, counting the cost of bringing the codes into a cache that held
# the 4-bit weights (one prompt pass of 64 / 128 / 256 tokens: 100 / 167 / 289 ms on the
# codes from cold, 87 / 165 / 327 on the 4-bit graph warm).
MEASURED_THRESHOLDS = {
    "int4": PassThresholds(float32_pass_tokens=512, codes8_pass_rows=16,
                           codes8_prompt_tokens=128),
    "gguf": PassThresholds(float32_pass_tokens=256, codes8_pass_rows=16,
                           codes8_prompt_tokens=128),
    "int8": PassThresholds(float32_pass_tokens=1024),
}


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
