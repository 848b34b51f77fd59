"""The GGUF file a checkpoint was imported from, found again and checked, for --quantize gguf.

model/gguf_import.py records where a checkpoint came from
(``training.imported_from``: format, path, architecture, tensor-type counts). The import
records no size or hash of the file, so "is it still the same file" is answered in two
steps: here, cheaply, from the header (the file exists, reads as GGUF, and has the
recorded architecture and the recorded count of tensors of each type); and later, exactly,
by export/gguf_blocks.py, which refuses unless every block it keeps dequantises bit for bit
to the checkpoint's own weight.

This module also knows which GGUF tensors make up each weight of our graphs: the graph
builders name their initializers (export/graphs.py, export/engine_graph.py) and llama.cpp
names its tensors (``blk.N.attn_q.weight``...); Q | K | V are one matrix in our graphs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np


class SourceRefused(ValueError):
    """--quantize gguf cannot use this checkpoint's source file (a one-line reason)."""


@dataclass(frozen=True)
class Part:
    """One GGUF tensor's rows inside a graph weight, and how its rows are reordered."""

    tensor: str
    unpermute_heads: int | None  # llama Q/K: undo llama.cpp's rotary row permutation


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


def open_source(training: dict[str, Any]) -> GGUFFile:
    """The GGUF file of a checkpoint's ``training`` record, or SourceRefused (one line)."""
    from model.gguf_import import open_gguf

    record = training.get("imported_from")
    if not isinstance(record, dict) or record.get("format") != "gguf":
        raise SourceRefused("--quantize gguf needs a checkpoint imported from a GGUF file "
                            "(attnserve import --gguf); this one was not")
    path = Path(str(record.get("path")))
    if not path.is_file():
        raise SourceRefused(f"--quantize gguf: the checkpoint's source file {path} is gone "
                            "(re-import it, or export with --quantize int4/int8)")
    try:
        reader = open_gguf(path)
    except ValueError as exc:
        raise SourceRefused(f"--quantize gguf: {exc}") from exc
    arch = _field(reader, "general.architecture")
    types = dict(Counter(t.tensor_type.name for t in reader.tensors))
    if arch != record.get("architecture") or types != record.get("tensor_types"):
        raise SourceRefused(
            f"--quantize gguf: {path} changed since the import (architecture {arch!r}, tensor "
            f"types {types}; the checkpoint recorded {record.get('architecture')!r}, "
            f"{record.get('tensor_types')})")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    kv = _field(reader, f"{arch}.attention.head_count_kv")
    kv_heads = heads if kv is None else int(kv[0] if isinstance(kv, list) else kv)
    tensors = {t.name: t for t in reader.tensors}
    weights = weight_map(str(arch), int(_field(reader, f"{arch}.block_count")), heads,
                         kv_heads, tensors)
    return GGUFFile(path, str(arch), tensors, weights)


def weight_map(arch: str, n_layers: int, heads: int, kv_heads: int,
               tensors: dict[str, gguf.ReaderTensor]) -> dict[str, list[Part]]:
    """Graph initializer name → its GGUF parts, for model.onnx's and engine.onnx's names."""
    out: dict[str, list[Part]] = {}
    for i in range(n_layers):
        blk = f"blk.{i}"
        if arch == "gpt2":
            qkv = [Part(f"{blk}.attn_qkv.weight", None)]
        else:
            rope = arch == "llama"
            qkv = [Part(f"{blk}.attn_q.weight", heads if rope else None),
                   Part(f"{blk}.attn_k.weight", kv_heads if rope else None),
                   Part(f"{blk}.attn_v.weight", None)]
        for name in (f"l{i}.qkv.w", f"l{i}.w_qkv"):  # model.onnx, engine.onnx
            out[name] = qkv
        for name in (f"l{i}.o.w", f"l{i}.w_o"):
            out[name] = [Part(f"{blk}.attn_output.weight", None)]
        for ours, theirs in (("gate", "ffn_gate"), ("up", "ffn_up"), ("down", "ffn_down")):
            out[f"l{i}.{ours}.w"] = [Part(f"{blk}.{theirs}.weight", None)]
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    # MatMul over the transpose (quantised graphs), Gemm(transB) over the (V, d) matrix
    for name in ("lm_head.w", "lm_head.weight", "tok_emb"):
        out[name] = [Part(head, None)]
    return {k: v for k, v in out.items() if all(p.tensor in tensors for p in v)}


def row_order(rows: int, heads: int | None) -> np.ndarray:
    """The row index order that turns a GGUF Q/K matrix back into transformers' layout:
    llama.cpp's converter moved each head's rows from halves (x_i, x_{i+hs/2}) to
    interleaved pairs (x_2i, x_2i+1); this is its inverse, as the import applies it (the
    rewrite then checks the result against the checkpoint's weights exactly)."""
    index = np.arange(rows)
    if heads is None:
        return index
    return index.reshape(heads, rows // heads // 2, 2).transpose(0, 2, 1).reshape(rows)
