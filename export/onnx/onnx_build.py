"""Writing ONNX graphs node by node, and saving several graphs over one weights file.

Every graph of an artifact (model.onnx, attention.onnx, engine.onnx) is built directly
from the checkpoint's tensors, the way onnxruntime-genai's model builder writes its
graphs, instead of being traced: tracing a 30-layer model through torch.export and the
onnxscript rewriter took 220 s per graph on 2 cores, building it takes well under one.

The graphs name their weights the same way and lay them out the same way (projections
as (in, out) for MatMul, the embedding as (V, d) for Gather and, through Gemm's
``transB``, for a tied LM head), so :class:`WeightsWriter` stores each distinct tensor once
in ``weights.bin`` and every graph points at its offset (ONNX external data). Large
tensors start at 64 KiB boundaries, which lets ONNX Runtime memory-map them on CPU
instead of reading a private copy per session.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

WEIGHTS_FILE = "weights.bin"
# Tensors below this many bytes (shape constants, scalars, norm scales of small models)
# stay inside the graph file; larger ones go to weights.bin.
EXTERNAL_MIN_BYTES = 1024
# ONNX Runtime memory-maps an external tensor whose offset is a multiple of the
# allocation granularity (4 KiB on Linux, 64 KiB on Windows).
ALIGNMENT = 64 * 1024
ALIGN_MIN_BYTES = 1 << 20
# where a placeholder initializer's values would be (:func:`placeholder`): no file
PLACEHOLDER = "<from the GGUF file's blocks>"


class Graph:
    """Accumulates initializers and nodes with unique names.

    With ``weights``, every initializer of at least ``EXTERNAL_MIN_BYTES`` goes straight
    into that :class:`WeightsWriter`'s file as the graph is built, so a graph never holds
    its weights in memory (a float32 graph of SmolLM2 held them three times over: 1.9 GB
    for 650 MB of weights, through ``helper.make_graph`` and ``make_model``'s copies).
    """

    def __init__(self, weights: WeightsWriter | None = None) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._names: set[str] = set()
        self._weights = weights

    def const(self, name: str, array: np.ndarray) -> str:
        """An initializer; a name already given returns the existing one (shared weights)."""
        if name not in self._names:
            self._names.add(name)
            if isinstance(array, StandIn):
                self.inits.append(placeholder(name, array))
                return name
            array = np.ascontiguousarray(array)
            if self._weights is not None and array.nbytes >= EXTERNAL_MIN_BYTES:
                self.inits.append(self._weights.store(name, array))
            else:
                self.inits.append(numpy_helper.from_array(array, name))
        return name

    def ints(self, name: str, values: list[int]) -> str:
        return self.const(name, np.asarray(values, np.int64))

    def op(self, op_type: str, inputs: list[str], name: str, n_out: int = 1,
           outputs: list[str] | None = None, domain: str = "", **attrs: Any) -> list[str]:
        outs = outputs or [name if n_out == 1 else f"{name}.{j}" for j in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=name, domain=domain,
                                           **attrs))
        return outs

    def one(self, op_type: str, inputs: list[str], name: str, domain: str = "",
            **attrs: Any) -> str:
        """A node with a single output, returned by name."""
        return self.op(op_type, inputs, name, domain=domain, **attrs)[0]


class StandIn(np.ndarray):
    """The shape of a weight whose values are not in memory: a parameter left on the meta
    device because the export builds it from a GGUF file's blocks (model/gguf/reader.py
    HeldWeights). A read-only view of one float32 zero; ``.T`` is one too; a graph stores
    it as a :func:`placeholder` that export/gguf/blocks.py replaces."""


def stand_in(shape: tuple[int, ...]) -> StandIn:
    return np.broadcast_to(np.zeros((), np.float32), shape).view(StandIn)


def f32(tensor: Any) -> np.ndarray:
    """A torch tensor (or array) as contiguous float32 numpy, what every initializer is; a
    :class:`StandIn` for a tensor on the meta device."""
    if getattr(tensor, "is_meta", False):
        return stand_in(tuple(tensor.shape))
    if hasattr(tensor, "detach"):
        tensor = tensor.detach().float().cpu().numpy()
    return np.ascontiguousarray(tensor, dtype=np.float32)


def placeholder(name: str, array: StandIn) -> onnx.TensorProto:
    """An initializer with ``array``'s shape and no values: a weight that
    export/gguf/blocks.py builds from the GGUF file's blocks. Its data points at
    :data:`PLACEHOLDER`, which no file is named, so a graph that still holds one cannot
    load (and :meth:`WeightsWriter.add` refuses it once the graphs are final)."""
    tensor = onnx.TensorProto(name=name, dims=array.shape, data_type=TensorProto.FLOAT,
                              data_location=TensorProto.EXTERNAL)
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", PLACEHOLDER
    return tensor


def is_placeholder(tensor: onnx.TensorProto) -> bool:
    return _location(tensor) == PLACEHOLDER


def make_model(graph: Graph, name: str, inputs: list[onnx.ValueInfoProto],
               outputs: list[onnx.ValueInfoProto], opset: int, doc: str,
               contrib: bool = False) -> onnx.ModelProto:
    imports = [helper.make_opsetid("", opset)]
    if contrib:
        imports.append(helper.make_opsetid("com.microsoft", 1))
    model = helper.make_model(helper.make_graph(graph.nodes, name, inputs, outputs,
                                                graph.inits),
                              opset_imports=imports, producer_name="attnserve")
    model.ir_version = 8
    model.doc_string = doc
    return model


def _location(tensor: onnx.TensorProto) -> str | None:
    """The file an external tensor's bytes are in; None for a tensor that holds them."""
    if tensor.data_location != TensorProto.EXTERNAL:
        return None
    return {e.key: e.value for e in tensor.external_data}.get("location")


def _tensor_bytes(tensor: onnx.TensorProto, base: Path | None) -> bytes:
    """A tensor's raw little-endian bytes, wherever it keeps them."""
    if tensor.data_location == TensorProto.EXTERNAL:
        if base is None:
            raise ValueError(f"tensor {tensor.name} is external but no directory was given")
        info = {e.key: e.value for e in tensor.external_data}
        with open(base / info["location"], "rb") as f:
            f.seek(int(info.get("offset", 0)))
            return f.read(int(info["length"]))
    if tensor.HasField("raw_data"):
        return tensor.raw_data
    return numpy_helper.to_array(tensor).tobytes()


class WeightsWriter:
    """Graphs saved over one weights.bin: ``add`` moves a graph's large initializers into it
    (each distinct tensor once across every graph added: equal dtype, shape and bytes share
    one entry whatever their names) and writes the graph file, and :meth:`store` writes one
    initializer while its graph is being built (:class:`Graph`), so no graph ever holds its
    weights. Building SmolLM2-135M's four
    float32 graphs that way instead of holding them all until one save took that stage
    from 4.4 GB to 1.0 GB (the process, PyTorch's model included; docs/export.md).

    Use as a context manager: weights.bin and the graph files are written under temporary
    names and renamed when the block ends without an error (``figures`` then holds the
    sizes for the manifest), so a failure leaves the previous files in place. Initializers
    that are already external are read from ``base`` (which may hold the weights.bin being
    replaced: it is read to the end of the block).
    """

    def __init__(self, directory: Path, base: Path | None = None) -> None:
        self.directory, self.base = directory, base
        self.figures: dict[str, Any] = {}
        self._index: dict[bytes, tuple[int, int]] = {}  # digest → (offset, length)
        self._files: list[str] = []
        self._referenced = 0  # bytes of every large initializer, shared ones each time
        self.added: dict[str, int] = {}  # graph file → bytes its add() stored new
        self._tmp = directory / f".{WEIGHTS_FILE}.tmp"
        self._blob: Any = None

    def __enter__(self) -> WeightsWriter:
        self._blob = open(self._tmp, "wb")  # closed in __exit__
        return self

    def _staged(self, file_name: str) -> Path:
        return self.directory / f".{file_name}.tmp"

    def _put(self, data_type: int, data: Any) -> tuple[int, int, bool]:
        """(offset, length, whether written now) of these bytes in the file, written unless
        equal ones were, whatever their shape (each graph's tensor proto keeps its own dims:
        attention.onnx's (L, d) ``steer`` default shares the steps graphs' (1, L, d) zeros)."""
        digest = hashlib.sha256(bytes([data_type]))
        digest.update(data)
        key = digest.digest()
        self._referenced += memoryview(data).nbytes
        new = key not in self._index
        if new:
            blob = self._blob
            offset, length = blob.tell(), memoryview(data).nbytes
            if length >= ALIGN_MIN_BYTES and offset % ALIGNMENT:
                offset += ALIGNMENT - offset % ALIGNMENT
                blob.seek(offset)
            blob.write(data)
            self._index[key] = (offset, length)
        return (*self._index[key], new)

    def _point(self, tensor: onnx.TensorProto, location: str, offset: int,
               length: int) -> None:
        """Make ``tensor`` external: its bytes at ``offset`` of ``location``."""
        for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data",
                      "uint64_data", "string_data"):
            tensor.ClearField(field)
        del tensor.external_data[:]
        tensor.data_location = TensorProto.EXTERNAL
        for k, v in (("location", location), ("offset", str(offset)),
                     ("length", str(length))):
            entry = tensor.external_data.add()
            entry.key, entry.value = k, v

    def store(self, name: str, array: np.ndarray) -> onnx.TensorProto:
        """An initializer whose bytes are written now (a graph being built,
        :class:`Graph`); it points at the file being written until :meth:`add` takes its
        graph."""
        if sys.byteorder != "little":  # ONNX's raw data is little-endian
            array = array.astype(array.dtype.newbyteorder("<"))
        tensor = onnx.TensorProto(name=name, dims=array.shape,
                                  data_type=helper.np_dtype_to_tensor_dtype(array.dtype))
        offset, length, _ = self._put(tensor.data_type,
                                      np.ascontiguousarray(array).data.cast("B"))
        self._point(tensor, self._tmp.name, offset, length)
        return tensor

    def add(self, file_name: str, model: onnx.ModelProto) -> None:
        """Store ``model``'s large initializers (the proto is changed to point at them)
        and write it, under a temporary name until the block ends."""
        for tensor in model.graph.initializer:
            if is_placeholder(tensor):  # replaced by the file's blocks after this add
                if self.base is not None:  # the final pass: every graph complete
                    raise ValueError(f"{file_name}: weight {tensor.name} was never built "
                                     "from the GGUF file's blocks")
                continue
            if _location(tensor) == self._tmp.name:  # stored while the graph was built
                info = {e.key: e.value for e in tensor.external_data}
                self._point(tensor, WEIGHTS_FILE, int(info["offset"]), int(info["length"]))
                continue
            data = _tensor_bytes(tensor, self.base)
            if len(data) < EXTERNAL_MIN_BYTES:
                continue
            offset, length, new = self._put(tensor.data_type, data)
            self.added[file_name] = self.added.get(file_name, 0) + (length if new else 0)
            del data
            self._point(tensor, WEIGHTS_FILE, offset, length)
        onnx.save_model(model, str(self._staged(file_name)))
        self._files.append(file_name)

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        blob, self._blob = self._blob, None
        if kind is not None:
            blob.close()
            for path in [self._tmp, *map(self._staged, self._files)]:
                path.unlink(missing_ok=True)
            return
        blob.truncate(blob.tell())
        blob.close()
        os.replace(self._tmp, self.directory / WEIGHTS_FILE)
        for file_name in self._files:
            os.replace(self._staged(file_name), self.directory / file_name)
        self.figures = {"weights_file": WEIGHTS_FILE,
                        "weights_bytes": (self.directory / WEIGHTS_FILE).stat().st_size,
                        "tensor_bytes_referenced": self._referenced,
                        "unique_tensors": len(self._index)}


def load_graph(path: Path) -> onnx.ModelProto:
    """A graph as :class:`WeightsWriter` wrote it, its external tensors left on disk."""
    return onnx.load(str(path), load_external_data=False)


def weight_bytes(path: Path) -> int:
    """Bytes of a graph's initializers, wherever they are stored."""
    total = 0
    for tensor in load_graph(path).graph.initializer:
        if is_placeholder(tensor):  # float32 values, were they written
            total += 4 * int(np.prod(tensor.dims))
        elif tensor.data_location == TensorProto.EXTERNAL:
            total += int({e.key: e.value for e in tensor.external_data}["length"])
        else:
            total += len(_tensor_bytes(tensor, None))
    return total
