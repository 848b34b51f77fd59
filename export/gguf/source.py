"""The GGUF file a checkpoint was imported from, found again and checked, for --quantize gguf.

model/gguf/to_checkpoint.py records where a checkpoint came from
(``training.imported_from``: format, path, size, sha256, architecture, tensor-type counts).
"Is it still the same file" is answered here from the size and sha256 (checkpoints
imported before those were recorded skip that check) and the header (the file reads as
GGUF, with the recorded architecture and count of tensors of each type); and later,
exactly, by export/gguf/blocks.py, which refuses unless every block it keeps dequantises
bit for bit to the checkpoint's own weight (the only check an older checkpoint gets).

Which GGUF tensors make up each weight of our graphs comes from the architecture registry
(``Architecture.gguf_sources``: llama.cpp's names and the import's own row reordering,
e.g. llama's Q/K permutation), so a new family needs nothing here. What this module adds
is our graphs' side: the graph builders name their initializers (export/onnx/model_graphs.py,
export/onnx/engine_graph.py: ``l0.qkv.w`` / ``l0.w_qkv`` hold Q | K | V, a feed-forward
weight is ``l0.{module}.w`` after its ``ffn`` attribute) and this maps those names to
our parameters.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from model.architectures.base import GGUFRows


class SourceRefused(ValueError):
    """--quantize gguf cannot use this checkpoint's source file (a one-line reason)."""


@dataclass(frozen=True, eq=False)
class Part:
    """One GGUF tensor's rows inside a graph weight: ``rows[i]`` is the file's row that is
    the weight's i-th row (output feature) of this part."""

    tensor: str
    rows: np.ndarray  # (rows,) int64


@dataclass(frozen=True)
class GGUFFile:
    """The checked source: its tensors by name, and which make up each graph weight."""

    path: Path
    arch: str
    tensors: dict[str, gguf.ReaderTensor]
    weights: dict[str, list[Part]]  # graph initializer name → its tensors, in row order


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def open_source(training: dict[str, Any], reader: gguf.GGUFReader | None = None) -> GGUFFile:
    """The GGUF file of a checkpoint's ``training`` record, or SourceRefused (one line).
    ``reader``: that file already open (a second memory map of it would count its pages
    in the process's resident set twice)."""
    from model.gguf.reader import file_sha256, open_gguf, read_config
    from service.contract.pages import release_file_pages

    record = training.get("imported_from")
    derived = training.get("merged_from") or training.get("finetuned_from")
    if isinstance(derived, dict):
        raise SourceRefused("--quantize gguf keeps a GGUF file's own blocks, and this "
                            "checkpoint's weights are a fine-tune's, not the file's; use "
                            "--quantize int8 or int4")
    if not isinstance(record, dict) or record.get("format") != "gguf":
        raise SourceRefused("--quantize gguf needs a checkpoint imported from a GGUF file "
                            "(attnserve import --gguf); this one was not")
    path = Path(str(record.get("path")))
    if not path.is_file():
        raise SourceRefused(f"--quantize gguf: the checkpoint's source file {path} is gone "
                            "(re-import it, or export with --quantize int4/int8)")
    _check_recorded(record, "size", path.stat().st_size, path)
    try:
        reader = reader if reader is not None else open_gguf(path)
    except ValueError as exc:
        raise SourceRefused(f"--quantize gguf: {exc}") from exc
    if "sha256" in record:
        _check_recorded(record, "sha256", file_sha256(reader), path)
        release_file_pages(path)  # the hash read every page: none is needed yet
    family = _field(reader, "general.architecture")
    types = dict(Counter(t.tensor_type.name for t in reader.tensors))
    if family != record.get("architecture") or types != record.get("tensor_types"):
        raise SourceRefused(
            f"--quantize gguf: {path} changed since the import (architecture {family!r}, tensor "
            f"types {types}; the checkpoint recorded {record.get('architecture')!r}, "
            f"{record.get('tensor_types')})")
    try:
        _, _, architecture, config = read_config(reader, path)
    except ValueError as exc:
        raise SourceRefused(f"--quantize gguf: {exc}") from exc
    tensors = {t.name: t for t in reader.tensors}
    rows = {name: int(t.shape[-1]) for name, t in tensors.items()}  # ne[-1]: numpy's rows
    sources = architecture.gguf_sources(str(family), config, rows)
    return GGUFFile(path, str(family), tensors, weight_map(config.n_layers, sources))


def _check_recorded(record: dict[str, Any], field: str, found: int | str, path: Path) -> None:
    """Refuse when the import recorded ``field`` and the file now has another value
    (checkpoints imported before the field was recorded skip the check)."""
    if field in record and record[field] != found:
        raise SourceRefused(f"--quantize gguf: {path} changed since the import: its {field} "
                            f"is {found}, training.imported_from.{field} recorded "
                            f"{record[field]} (re-import it)")


BLOCK_PARAMS = re.compile(r"blocks\.\d+\.(attn\.w_[qkvo]|ffn\.\w+)\.weight|tok_emb\.weight"
                          r"|lm_head\.weight")


def read_as_blocks(param: str) -> bool:
    """Whether the graphs read our parameter ``param`` as blocks when its tensor's type is
    kept (:func:`weight_map`'s parameters: the projections, the embedding and the head);
    any other (GPT-2's position table, the norms) is a float32 initializer."""
    return BLOCK_PARAMS.fullmatch(param) is not None


def weight_map(n_layers: int, sources: dict[str, GGUFRows]) -> dict[str, list[Part]]:
    """Graph initializer name → its GGUF parts, for model.onnx's and engine.onnx's names,
    given our parameters' GGUF rows (``Architecture.gguf_sources``)."""
    params: dict[str, list[str]] = {}
    for i in range(n_layers):
        b = f"blocks.{i}"
        qkv = [f"{b}.attn.w_q.weight", f"{b}.attn.w_k.weight", f"{b}.attn.w_v.weight"]
        for name in (f"l{i}.qkv.w", f"l{i}.w_qkv"):  # model.onnx, engine.onnx
            params[name] = qkv
        for name in (f"l{i}.o.w", f"l{i}.w_o"):
            params[name] = [f"{b}.attn.w_o.weight"]
    for param in sources:  # feed-forward weights are named after their module
        if (match := re.fullmatch(r"blocks\.(\d+)\.ffn\.(\w+)\.weight", param)) is not None:
            params[f"l{match[1]}.{match[2]}.w"] = [param]
    # MatMul over the transpose (quantised graphs), Gemm(transB) over the (V, d) matrix,
    # which is the embedding itself when tied
    for name in ("lm_head.w", "lm_head.weight"):
        params[name] = ["lm_head.weight"]
    params["tok_emb"] = ["tok_emb.weight"]
    return {name: _parts([sources[p] for p in ours]) for name, ours in params.items()
            if all(p in sources for p in ours)}


def _parts(rows: list[GGUFRows]) -> list[Part]:
    """One part per run of consecutive rows of the same tensor (GPT-2's attn_qkv is one
    tensor holding Q | K | V: one part, as the graph's Q | K | V weight is one matrix)."""
    parts: list[Part] = []
    for r in rows:
        if parts and parts[-1].tensor == r.tensor:
            parts[-1] = Part(r.tensor, np.concatenate([parts[-1].rows, r.rows]))
        else:
            parts.append(Part(r.tensor, r.rows))
    return parts
