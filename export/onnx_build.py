"""Writing ONNX graphs node by node, and saving several graphs over one weights file.

Every graph of an artifact (model.onnx, attention.onnx, engine.onnx) is built directly
from the checkpoint's tensors, the way onnxruntime-genai's model builder writes its
graphs, instead of being traced: tracing a 30-layer model through torch.export and the
onnxscript rewriter took 220 s per graph on 2 cores, building it takes well under one.

The graphs name their weights the same way and lay them out the same way (projections
as (in, out) for MatMul, the embedding as (V, d) for Gather and, through Gemm's
``transB``, for a tied LM head), so :func:`save_graphs` stores each distinct tensor once
in ``weights.bin`` and every graph points at its offset (ONNX external data). Large
tensors start at 64 KiB boundaries, which lets ONNX Runtime memory-map them on CPU
instead of reading a private copy per session.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
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


class Graph:
    """Accumulates initializers and nodes with unique names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._names: set[str] = set()

    def const(self, name: str, array: np.ndarray) -> str:
        """An initializer; a name already given returns the existing one (shared weights)."""
        if name not in self._names:
            self._names.add(name)
            self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
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


def f32(tensor: Any) -> np.ndarray:
    """A torch tensor (or array) as contiguous float32 numpy."""
    if hasattr(tensor, "detach"):
        tensor = tensor.detach().float().cpu().numpy()
    return np.ascontiguousarray(tensor, dtype=np.float32)


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


def save_graphs(directory: Path, models: Mapping[str, onnx.ModelProto],
                base: Path | None = None) -> dict[str, Any]:
    """Write each ``models[file]`` into ``directory`` with its large initializers stored
    once, across all graphs, in weights.bin; return sizes for the manifest.

    Equal tensors (same dtype, shape and bytes) share one entry whatever their names,
    so the tied embedding, or a weight two graphs read, costs its bytes once. Initializers
    that are already external are read from ``base``. weights.bin is written under a
    temporary name and renamed, so a failure leaves the previous one in place.
    """
    index: dict[bytes, tuple[int, int]] = {}  # digest → (offset, length)
    tmp = directory / f".{WEIGHTS_FILE}.tmp"
    referenced = 0
    with open(tmp, "wb") as blob:
        for model in models.values():
            for tensor in model.graph.initializer:
                data = _tensor_bytes(tensor, base)
                if len(data) < EXTERNAL_MIN_BYTES:
                    continue
                referenced += len(data)
                key = hashlib.sha256(
                    bytes([tensor.data_type]) + repr(list(tensor.dims)).encode() + data
                ).digest()
                if key not in index:
                    offset = blob.tell()
                    if len(data) >= ALIGN_MIN_BYTES and offset % ALIGNMENT:
                        offset += ALIGNMENT - offset % ALIGNMENT
                        blob.seek(offset)
                    blob.write(data)
                    index[key] = (offset, len(data))
                offset, length = index[key]
                tensor.ClearField("raw_data")
                for field in ("float_data", "int32_data", "int64_data", "double_data",
                              "uint64_data", "string_data"):
                    tensor.ClearField(field)
                del tensor.external_data[:]
                tensor.data_location = TensorProto.EXTERNAL
                for k, v in (("location", WEIGHTS_FILE), ("offset", str(offset)),
                             ("length", str(length))):
                    entry = tensor.external_data.add()
                    entry.key, entry.value = k, v
        blob.truncate(blob.tell())
    os.replace(tmp, directory / WEIGHTS_FILE)
    for file_name, model in models.items():
        onnx.save_model(model, str(directory / file_name))
    stored = (directory / WEIGHTS_FILE).stat().st_size
    return {"weights_file": WEIGHTS_FILE, "weights_bytes": stored,
            "tensor_bytes_referenced": referenced, "unique_tensors": len(index)}


def load_graph(path: Path) -> onnx.ModelProto:
    """A graph as written by :func:`save_graphs`, its external tensors left on disk."""
    return onnx.load(str(path), load_external_data=False)


def weight_bytes(path: Path) -> int:
    """Bytes of a graph's initializers, wherever they are stored."""
    total = 0
    for tensor in load_graph(path).graph.initializer:
        if tensor.data_location == TensorProto.EXTERNAL:
            total += int({e.key: e.value for e in tensor.external_data}["length"])
        else:
            total += len(_tensor_bytes(tensor, None))
    return total
