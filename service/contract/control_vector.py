"""llama.cpp's control-vector file: one steering direction per layer, read and written.

The layout is the one llama.cpp's ``common_control_vector_load`` (common/common.cpp) reads
and its ``llama-cvector-generator`` writes: ``general.architecture`` = ``controlvector``,
``controlvector.model_hint`` (the model's architecture, a hint only),
``controlvector.layer_count`` (int32: how many directions) and one float32 1-D tensor
``direction.<k>`` of the model's width per layer ``k >= 1``.

Layer numbering is llama.cpp's (src/llama-adapter.cpp, ``llama_adapter_cvec``): direction
``k`` is added to the residual stream after block ``k``, counting blocks from 0, so the
first block's output is never steered and ``k`` runs 1 … n_layers − 1 (a direction beyond
that is never applied, and is refused here when the model is known).

numpy and gguf only: the service reads these files without torch; the writer is beside
the reader so that both sides of the format live in one place.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from service.contract.atomic_gguf import write_atomically

if TYPE_CHECKING:
    from gguf import GGUFReader, GGUFWriter

ARCHITECTURE = "controlvector"
MODEL_HINT_KEY = f"{ARCHITECTURE}.model_hint"
LAYER_COUNT_KEY = f"{ARCHITECTURE}.layer_count"
TENSOR_PREFIX = "direction."
_TENSOR_NAME = re.compile(r"direction\.([0-9]+)")


class ControlVectorError(ValueError):
    """A control-vector file (or the vector to write) is not what llama.cpp would apply."""


@dataclass(frozen=True)
class ControlVector:
    """Directions by llama.cpp layer index ``k >= 1`` (added after block ``k``, 0-based),
    each a float32 (d_model,) array."""

    directions: Mapping[int, np.ndarray]
    model_hint: str = ""
    layers: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(sorted(self.directions)))
        check_directions(self.directions)

    @property
    def width(self) -> int:
        return int(next(iter(self.directions.values())).shape[0])


def check_directions(directions: Mapping[int, np.ndarray], source: str = "control vector",
                     d_model: int | None = None, n_layers: int | None = None) -> None:
    """Refuse, in one line naming the culprit, what llama.cpp would refuse or never apply:
    no directions, a layer below 1 (or past the model's last block), a tensor that is not
    1-D float32, widths that differ (or differ from the model's), NaN or infinity."""
    if not directions:
        raise ControlVectorError(f"{source} holds no direction tensors")
    width = None
    for layer in sorted(directions):
        values = directions[layer]
        name = f"{TENSOR_PREFIX}{layer}"
        if not isinstance(layer, int) or layer < 1:
            raise ControlVectorError(f"{source}: {name}: layers count from 1 (llama.cpp never "
                                     "steers the first block's output)")
        if n_layers is not None and layer >= n_layers:
            raise ControlVectorError(f"{source}: {name} is past the model's last steerable "
                                     f"layer {n_layers - 1} ({n_layers} layers)")
        if values.dtype != np.float32 or values.ndim != 1:
            raise ControlVectorError(f"{source}: {name} is {values.dtype} of shape "
                                     f"{tuple(values.shape)}; llama.cpp reads 1-D float32")
        if width is None:
            width = values.shape[0]
        if values.shape[0] != width:
            raise ControlVectorError(f"{source}: {name} has width {values.shape[0]}, "
                                     f"{TENSOR_PREFIX}{min(directions)} has {width}")
        if d_model is not None and values.shape[0] != d_model:
            raise ControlVectorError(f"{source}: {name} has width {values.shape[0]}; the "
                                     f"model's d_model is {d_model}")
        if not np.isfinite(values).all():
            raise ControlVectorError(f"{source}: {name} holds NaN or infinity")


def read_control_vector(path: str | os.PathLike[str], d_model: int | None = None,
                        n_layers: int | None = None) -> ControlVector:
    """The file's directions, checked as llama.cpp checks them (and against the model when
    ``d_model`` / ``n_layers`` are given); a bad file raises ControlVectorError."""
    import gguf

    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError, IndexError) as exc:  # gguf raises these on a bad header
        raise ControlVectorError(f"{path} is not a readable GGUF file: {exc}") from exc
    arch = _string(reader, "general.architecture")
    if arch != ARCHITECTURE:
        raise ControlVectorError(f"{path}: general.architecture is {arch!r}, not "
                                 f"{ARCHITECTURE!r}: not a control vector")
    directions: dict[int, np.ndarray] = {}
    for tensor in reader.tensors:
        match = _TENSOR_NAME.fullmatch(tensor.name)
        if match is None or (match[1] != "0" and match[1].startswith("0")):
            raise ControlVectorError(f"{path}: tensor {tensor.name!r} is not named "
                                     f"{TENSOR_PREFIX}<layer>")
        if tensor.tensor_type != gguf.GGMLQuantizationType.F32:
            raise ControlVectorError(f"{path}: {tensor.name} is {tensor.tensor_type.name}; "
                                     "llama.cpp reads F32 directions only")
        ne = [int(n) for n in tensor.shape]
        if any(n != 1 for n in ne[1:]):  # ggml_n_dims: trailing 1s do not count
            raise ControlVectorError(f"{path}: {tensor.name} has shape {ne}; a direction is "
                                     "1-D")
        directions[int(match[1])] = np.array(tensor.data, dtype=np.float32).reshape(ne[0])
    check_directions(directions, str(path), d_model, n_layers)
    count = reader.fields.get(LAYER_COUNT_KEY)
    if count is not None and count.contents() != len(directions):
        raise ControlVectorError(f"{path}: {LAYER_COUNT_KEY} is {count.contents()!r} but the "
                                 f"file holds {len(directions)} directions")
    return ControlVector(directions, _string(reader, MODEL_HINT_KEY) or "")


def _string(reader: GGUFReader, key: str) -> str | None:
    field_ = reader.fields.get(key)
    if field_ is None:
        return None
    value = field_.contents()
    return value if isinstance(value, str) else repr(value)


def write_control_vector(vector: ControlVector, path: str | os.PathLike[str]) -> Path:
    """Write ``vector`` as cvector-generator does (directions in layer order), to a
    temporary sibling renamed into place: a failed write leaves nothing behind."""
    import gguf

    out = Path(path)
    if out.suffix != ".gguf":
        raise ControlVectorError(f"{out}: a control vector's file name ends in .gguf")

    def write(tmp: Path) -> GGUFWriter:
        writer = gguf.GGUFWriter(tmp, ARCHITECTURE)
        writer.add_string(MODEL_HINT_KEY, vector.model_hint)
        writer.add_int32(LAYER_COUNT_KEY, len(vector.layers))
        for layer in vector.layers:
            writer.add_tensor(f"{TENSOR_PREFIX}{layer}",
                              np.ascontiguousarray(vector.directions[layer]))
        return writer

    return write_atomically(write, out)

