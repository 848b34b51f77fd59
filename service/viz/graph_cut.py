"""Cut an ONNX model down to the nodes that some of its outputs need.

ONNX Runtime runs every node of a graph whatever outputs a run fetches, and keeps every
graph output alive until the run ends. Measured on SmolLM2's attention.onnx (30 layers,
180 outputs) at 600 tokens: fetching layer 0's weights alone ran all 1,578 kernels and
peaked at the same 1.9 GB RSS as fetching every output. A graph whose outputs are only the
requested ones runs only their ancestors (layer 0's weights: 56 nodes).

The serving image has protobuf (onnxruntime depends on it) but not the onnx package, so
the few fields touched here are read and written on the protobuf wire directly; every
other byte of the model (initializers with their external-data references, opsets,
metadata) is copied unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

# Field numbers from onnx.proto.
MODEL_GRAPH = 7
GRAPH_NODE, GRAPH_INITIALIZER, GRAPH_INPUT, GRAPH_OUTPUT = 1, 5, 11, 12
VALUE_INFO_TYPE, TYPE_TENSOR, TENSOR_TYPE_SHAPE, SHAPE_DIM, DIM_VALUE = 2, 1, 2, 1, 1
NODE_INPUT, NODE_OUTPUT, NODE_OP_TYPE = 1, 2, 4
VALUE_INFO_NAME = 1
TENSOR_DIMS, TENSOR_DATA_TYPE, TENSOR_NAME, TENSOR_EXTERNAL_DATA = 1, 2, 8, 13
ENTRY_KEY, ENTRY_VALUE = 1, 2
LEN = 2  # wire type of strings, bytes and embedded messages
# Nodes whose subgraphs may read values that their inputs do not list.
CONTROL_FLOW = {"If", "Loop", "Scan", "SequenceMap"}


@dataclass(frozen=True)
class Field:
    number: int
    wire: int
    raw: bytes  # the whole field: key, length and payload, as it appears in the message
    payload: bytes  # LEN fields: the bytes after the length; others: empty


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return value, pos
        shift += 7


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def fields(data: bytes) -> Iterator[Field]:
    """The fields of one serialized message, in order."""
    pos = 0
    while pos < len(data):
        start = pos
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        payload = b""
        if wire == 0:
            _, pos = _varint(data, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == LEN:
            size, pos = _varint(data, pos)
            payload = data[pos:pos + size]
            pos += size
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        if pos > len(data):
            raise ValueError("truncated protobuf field")
        yield Field(number, wire, data[start:pos], payload)


@dataclass(frozen=True)
class ExternalTensor:
    """An initializer whose bytes lie in a file beside the model (ONNX external data)."""

    name: str
    data_type: int  # onnx.TensorProto.DataType
    dims: tuple[int, ...]
    location: str
    offset: int
    length: int


def external_tensors(model: bytes) -> list[ExternalTensor]:
    """The initializers of ``model``'s graph stored as external data."""
    graph = next((f for f in fields(model) if f.number == MODEL_GRAPH), None)
    out = []
    for f in fields(graph.payload if graph is not None else b""):
        if f.number != GRAPH_INITIALIZER:
            continue
        dims: list[int] = []
        data_type, name, entries = 0, "", {}
        for g in fields(f.payload):
            if g.number == TENSOR_DIMS and g.wire == LEN:  # packed
                pos = 0
                while pos < len(g.payload):
                    value, pos = _varint(g.payload, pos)
                    dims.append(value)
            elif g.number == TENSOR_DIMS:
                dims.append(_varint(g.raw, 1)[0])
            elif g.number == TENSOR_DATA_TYPE:
                data_type = _varint(g.raw, 1)[0]
            elif g.number == TENSOR_NAME:
                name = g.payload.decode()
            elif g.number == TENSOR_EXTERNAL_DATA:
                entry = {e.number: e.payload.decode() for e in fields(g.payload)}
                entries[entry[ENTRY_KEY]] = entry.get(ENTRY_VALUE, "")
        if "location" in entries and "length" in entries:
            out.append(ExternalTensor(name, data_type, tuple(dims), entries["location"],
                                      int(entries.get("offset", 0)), int(entries["length"])))
    return out


def graph_input_shapes(model: bytes) -> dict[str, tuple[int | None, ...]]:
    """Each graph input's shape (None for a symbolic or unknown dimension), read from the
    model's bytes without the weights: what the server checks an adapter against before
    it starts (no ONNX Runtime session, no onnx package)."""
    graph = next((f for f in fields(model) if f.number == MODEL_GRAPH), None)
    shapes: dict[str, tuple[int | None, ...]] = {}
    for f in fields(graph.payload if graph is not None else b""):
        if f.number != GRAPH_INPUT:
            continue
        name, dims = _strings(f.payload, VALUE_INFO_NAME)[0], []
        for kind in (g for g in fields(f.payload) if g.number == VALUE_INFO_TYPE):
            for tensor in (g for g in fields(kind.payload) if g.number == TYPE_TENSOR):
                for shape in (g for g in fields(tensor.payload) if g.number == TENSOR_TYPE_SHAPE):
                    for dim in (g for g in fields(shape.payload) if g.number == SHAPE_DIM):
                        value = next((_varint(d.raw, 1)[0] for d in fields(dim.payload)
                                      if d.number == DIM_VALUE and d.wire == 0), None)
                        dims.append(value)
        shapes[name] = tuple(dims)
    return shapes


def _len_field(number: int, payload: bytes) -> bytes:
    return _encode_varint(number << 3 | LEN) + _encode_varint(len(payload)) + payload


def _strings(message: bytes, number: int) -> list[str]:
    return [f.payload.decode() for f in fields(message) if f.number == number and f.wire == LEN]


def cut(model: bytes, outputs: Sequence[str]) -> bytes:
    """``model`` with only ``outputs`` as graph outputs and only the nodes they depend on.

    Raises ValueError for a name that is not a graph output, or for a graph with control
    flow (a subgraph may use values its node does not list as inputs).
    """
    graph_field = next((f for f in fields(model) if f.number == MODEL_GRAPH), None)
    if graph_field is None:
        raise ValueError("the model has no graph")
    graph = list(fields(graph_field.payload))
    declared = {_strings(f.payload, VALUE_INFO_NAME)[0]: f for f in graph
                if f.number == GRAPH_OUTPUT}
    missing = [n for n in outputs if n not in declared]
    if missing:
        raise ValueError(f"not outputs of the graph: {missing[:4]}")
    nodes = [f for f in graph if f.number == GRAPH_NODE]
    needed = set(outputs)
    keep: set[int] = set()
    for i in range(len(nodes) - 1, -1, -1):  # nodes are in topological order
        node = nodes[i].payload
        if not needed.intersection(_strings(node, NODE_OUTPUT)):
            continue
        if _strings(node, NODE_OP_TYPE)[0] in CONTROL_FLOW:
            raise ValueError("graphs with control flow are not cut")
        keep.add(i)
        needed.update(_strings(node, NODE_INPUT))
    wanted = set(outputs)
    kept_nodes = iter(range(len(nodes)))
    body = bytearray()
    for f in graph:
        if f.number == GRAPH_NODE:
            if next(kept_nodes) in keep:
                body += f.raw
        elif f.number == GRAPH_OUTPUT:
            if _strings(f.payload, VALUE_INFO_NAME)[0] in wanted:
                body += f.raw
        else:
            body += f.raw
    out = bytearray()
    for f in fields(model):
        out += _len_field(MODEL_GRAPH, bytes(body)) if f.number == MODEL_GRAPH else f.raw
    return bytes(out)
