"""Our parameters laid out as llama.cpp's tensors, and the GGUF file a checkpoint comes from.

Writing GGUF is reading it backwards. The import knows, for every parameter of ours, which
rows of which GGUF tensor hold it, in our order (``Architecture.gguf_sources``: llama.cpp's
names, its Q/K row permutation for llama-type rotary, the fused tensors Phi-3 and GPT-2
files keep, the tied head). Placing each parameter's rows back at those rows of a tensor of
the file's shape is the exact inverse, so a model written here reads back as the weights
it was written from, for every family the import reads.

A checkpoint imported from a GGUF file holds that file (model.gguf); one derived from such
a checkpoint (a fine-tune, a merge) records its base (``finetuned_from`` / ``merged_from``),
whose file gives the metadata (hyper-parameters, tokenizer) the new file keeps.

Also here, shared by the model and adapter writers: the output types and their encoding
with gguf's own quantisers (the file is written by service/contract/atomic_gguf.py).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from model.architectures.base import GGUFRows
from model.checkpoint import GGUF_WEIGHTS_FILE


class GGUFOutRefused(ValueError):
    """A checkpoint or adapter that cannot be written as GGUF (one line)."""


Q = gguf.GGMLQuantizationType
OUTTYPES: dict[str, Q] = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0,
                          "q5_1": Q.Q5_1, "q5_0": Q.Q5_0, "q4_1": Q.Q4_1, "q4_0": Q.Q4_0}
FILE_TYPES = {Q.F32: gguf.LlamaFileType.ALL_F32, Q.F16: gguf.LlamaFileType.MOSTLY_F16,
              Q.BF16: gguf.LlamaFileType.MOSTLY_BF16, Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
              Q.Q5_1: gguf.LlamaFileType.MOSTLY_Q5_1, Q.Q5_0: gguf.LlamaFileType.MOSTLY_Q5_0,
              Q.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1, Q.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0}
# The 4- and 5-bit types, under which llama-quantize keeps the output head finer
NARROW = frozenset({Q.Q5_1, Q.Q5_0, Q.Q4_1, Q.Q4_0})
HEAD_KIND = Q.Q8_0


def kind_for(name: str, kind: Q, names: Collection[str]) -> Q:
    """The type tensor ``name`` is written as under ``--outtype`` ``kind``: the output head
    (the token embedding, where the head is tied to it) stays Q8_0 under the 4- and 5-bit
    types, as llama-quantize keeps it (its Q6_K where rows are multiples of 256, Q8_0
    otherwise; gguf's quantisers have no Q6_K), as SmolLM2's own Q4_1 file holds its tied
    embedding."""
    head = "output.weight" if "output.weight" in names else "token_embd.weight"
    return HEAD_KIND if kind in NARROW and name == head else kind


def encode(data: np.ndarray, kind: Q) -> tuple[np.ndarray, Q]:
    """``data`` (float32) as ``kind``'s bytes, or F16 for a matrix whose rows its blocks
    do not divide, F32 for a vector."""
    if data.ndim < 2 or kind == Q.F32:
        return np.ascontiguousarray(data, np.float32), Q.F32
    block = gguf.GGML_QUANT_SIZES[kind][0]
    if data.shape[-1] % block:
        kind = Q.F16
    return gguf.quants.quantize(np.ascontiguousarray(data, np.float32), kind), kind


def check_out(out: Path, force: bool) -> None:
    if out.suffix != ".gguf":
        raise GGUFOutRefused(f"--out {out}: a GGUF file's name ends in .gguf")
    if out.is_dir():
        raise GGUFOutRefused(f"--out {out} is a directory; give the file to write")
    if out.exists() and not force:
        raise GGUFOutRefused(f"{out} exists; pass --force to replace it")


@dataclass(frozen=True)
class TensorLayout:
    """One file tensor and the parameters of ours whose rows fill it."""

    name: str  # llama.cpp's, e.g. blk.0.attn_q.weight
    shape: tuple[int, ...]  # numpy order: (rows, columns) or (n,)
    parts: tuple[tuple[str, np.ndarray], ...]  # (our parameter, its rows in the file)


def layouts(sources: dict[str, GGUFRows], shapes: dict[str, tuple[int, ...]],
            tied: bool) -> list[TensorLayout]:
    """Every file tensor our parameters fill, in ``shapes``' order (the file's); a tied head
    fills nothing of its own (llama.cpp reads token_embd for it)."""
    by_tensor: dict[str, list[tuple[str, np.ndarray]]] = {}
    for param, source in sources.items():
        if tied and param == "lm_head.weight":
            continue
        by_tensor.setdefault(source.tensor, []).append((param, source.rows))
    out = []
    for name, shape in shapes.items():
        if name not in by_tensor:
            continue
        parts = tuple(by_tensor[name])
        covered = np.sort(np.concatenate([rows for _, rows in parts]))
        if not np.array_equal(covered, np.arange(shape[0])):
            raise GGUFOutRefused(f"{name}: our parameters {[p for p, _ in parts]} do not fill "
                                 f"its {shape[0]} rows exactly once")
        out.append(TensorLayout(name, shape, parts))
    return out


def assemble(layout: TensorLayout, weights: dict[str, np.ndarray]) -> np.ndarray:
    """The file tensor (float32, numpy order) from our parameters' values."""
    data = np.zeros(layout.shape, np.float32)
    for param, rows in layout.parts:
        data[rows] = weights[param]
    return data


def numpy_shape(tensor: gguf.ReaderTensor) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))  # ne[0] is innermost


def file_rows(reader: gguf.GGUFReader) -> dict[str, int]:
    return {t.name: numpy_shape(t)[0] for t in reader.tensors}


def source_file(ckpt_dir: Path, training: dict[str, Any]) -> Path | None:
    """The GGUF file the checkpoint's weights come from: the one it holds, else its base's
    (down through fine-tunes and merges: the base checkpoint's held file, else the import's
    recorded path, checked by size); None for a model that never was a GGUF file."""
    held = ckpt_dir / GGUF_WEIGHTS_FILE
    if held.is_file():
        return held
    record: Any = training
    base: str | None = None
    while isinstance(record, dict):
        imported = record.get("imported_from")
        if isinstance(imported, dict):
            if imported.get("format") != "gguf":
                return None  # a Hugging Face directory's
            candidates = ([Path(base) / GGUF_WEIGHTS_FILE] if base else []) + [
                Path(str(imported.get("path")))]
            size = imported.get("size")
            for path in candidates:
                if path.is_file() and (size is None or path.stat().st_size == int(size)):
                    return path
            raise GGUFOutRefused(f"the GGUF file this checkpoint descends from is gone "
                                 f"({', '.join(map(str, candidates))}); import it again")
        parent = record.get("finetuned_from") or record.get("merged_from")
        if not isinstance(parent, dict):
            return None
        base, record = parent.get("checkpoint"), parent.get("base_training")
    return None
