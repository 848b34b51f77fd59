"""A GGUF-op graph for a host where the op library cannot load: its blocks dequantised.

An artifact exported with ``--kernel ggml`` holds each weight as the GGUF file's blocks
behind ``GgufMatMul`` / ``GgufGather`` nodes. Where the library is not built, or built for
CPU features this CPU lacks (service/ops/__init__.py), the graph would not load at all.
Rather than refuse to serve, the session layer runs this rewrite: every op node becomes
ONNX Runtime's own ``MatMul`` / ``Gather`` over the blocks dequantised to float32 by the
``gguf`` package (the same numbers the op computes at float activations, so greedy tokens
stay those of the float32 model), and ``CachedAttention`` the ``GroupQueryAttention`` whose
contract it keeps (over a float16 cache: the cache cast to float32 and the present back,
since ONNX Runtime's kernel takes one type for the query and the cache), in a copy of the
graph written to a temporary folder.
The cost is memory and speed: 4 bytes a weight instead of the file's ~0.6, and ONNX
Runtime's float32 kernels. The session layer says so in one log line.

Weights that ggml's repack laid out 8 rows at a time (``layout="repacked_8x8"``, Q4_0 and
IQ4_NL: ggml's ``make_block_q4_0x8`` / ``make_block_iq4_nlx8``) are put back into the
file's rows first, here in numpy, since the library that could unpack them is the one
missing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from service import ops
from service.ops import swiglu

GROUP_ROWS = 8  # rows interleaved in one group of the repacked layout
BLOCK_WEIGHTS = 32  # Q4_0 / IQ4_NL: weights in a block
HALF_BYTES = 2  # a block's float16 scale
QUANT_BYTES = BLOCK_WEIGHTS // 2  # a block's 4-bit codes
CONTRIB = "com.microsoft"  # ONNX Runtime's own ops' domain (GroupQueryAttention)
CHUNK_BYTES = 8  # the repack interleaves the codes 8 bytes at a time
Q4_0_XOR = 0x88  # make_block_q4_0x8 flips each code's top bit (signed nibbles for AVX2)


def unpack_repacked(groups: np.ndarray, ggml_type: int, k: int) -> np.ndarray:
    """(N, row_bytes) uint8 in ggml's 8-row repack layout → the file's rows, same shape.

    Each group of 8 rows holds, block column by block column, a ``block_x8``: the 8 rows'
    float16 scales, then their codes in 16 chunks of 8 bytes, chunk i from row i % 8 at
    byte (i // 8) * 8 of that row's codes (XOR 0x88 for Q4_0)."""
    import gguf

    n, row_bytes = groups.shape
    blocks = k // BLOCK_WEIGHTS
    block_bytes = HALF_BYTES + QUANT_BYTES
    if ggml_type not in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.IQ4_NL):
        raise ValueError(f"the repacked layout has no type {ggml_type}")
    if n % GROUP_ROWS or k % BLOCK_WEIGHTS or row_bytes != blocks * block_bytes:
        raise ValueError(f"({n}, {row_bytes}) bytes are not {GROUP_ROWS}-row groups of "
                         f"{k} weights")
    x8 = groups.reshape(n // GROUP_ROWS, blocks, GROUP_ROWS * block_bytes)  # (G, B, 144)
    scales = x8[..., :GROUP_ROWS * HALF_BYTES].reshape(-1, blocks, GROUP_ROWS, HALF_BYTES)
    chunks = x8[..., GROUP_ROWS * HALF_BYTES:].reshape(
        -1, blocks, QUANT_BYTES // CHUNK_BYTES, GROUP_ROWS, CHUNK_BYTES)  # (G, B, c, r, 8)
    codes = chunks.transpose(0, 3, 1, 2, 4).reshape(-1, GROUP_ROWS, blocks, QUANT_BYTES)
    if ggml_type == gguf.GGMLQuantizationType.Q4_0:
        codes = codes ^ np.uint8(Q4_0_XOR)
    rows = np.concatenate([scales.transpose(0, 2, 1, 3), codes], axis=-1)  # (G, r, B, 18)
    return np.ascontiguousarray(rows.reshape(n, row_bytes))


def dequantise(stored: np.ndarray, ggml_type: int, k: int,
               layout: str = ops.ROWS_LAYOUT) -> np.ndarray:
    """(N, row_bytes) uint8 GGUF rows (or their repacked layout) → (N, k) float32."""
    import gguf

    rows = unpack_repacked(stored, ggml_type, k) if layout == ops.REPACKED_LAYOUT else stored
    weights = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(ggml_type))
    return np.asarray(weights, dtype=np.float32).reshape(stored.shape[0], k)


def _float32_cache(node: Any, half_caches: set[str]) -> list[Any]:
    """GroupQueryAttention ``node`` as it is, or, where its past key / value are graph inputs
    in ``half_caches`` (float16), between Casts: the past to float32 before it, its presents
    back to float16 after (the present outputs keep their names, so the engine binds them to
    its float16 pool as before)."""
    import onnx

    past = list(node.input[3:5])
    if not any(name in half_caches for name in past):
        return [node]
    types = onnx.TensorProto
    before = [onnx.helper.make_node("Cast", [name], [f"{name}.float32"], to=types.FLOAT,
                                    name=f"{node.name}.{name}.float32") for name in past]
    presents = list(node.output[1:3])
    after = [onnx.helper.make_node("Cast", [f"{name}.float32"], [name], to=types.FLOAT16,
                                   name=f"{node.name}.{name}.float16") for name in presents]
    for i, name in enumerate(past):
        node.input[3 + i] = f"{name}.float32"
    for i, name in enumerate(presents):
        node.output[1 + i] = f"{name}.float32"
    return [*before, node, *after]


def write_dequantised(model: Path | bytes, external_data_dir: Path | None,
                      out_dir: Path) -> tuple[Path, set[str], int, int]:
    """The graph ``model`` (a file, or its bytes with weights.bin in ``external_data_dir``)
    with every GgufMatMul / GgufGather replaced by MatMul / Gather over float32 weights,
    written to ``out_dir`` (model.onnx and its weights). Returns (the new graph's path, the
    names of the initializers it no longer has, the GGUF bytes replaced, the float32 bytes
    now in their place)."""
    import onnx
    from onnx import external_data_helper, numpy_helper

    if isinstance(model, bytes):
        proto = onnx.load_model_from_string(model)
        base = external_data_dir
    else:
        proto = onnx.load_model(str(model), load_external_data=False)
        base = model.parent if external_data_dir is None else external_data_dir
    if base is not None:
        external_data_helper.load_external_data_for_model(proto, str(base))
    graph = proto.graph
    stored = {init.name: init for init in graph.initializer}
    dense: dict[str, np.ndarray] = {}  # W → its rows dequantised (N, K), once
    floats: dict[tuple[str, bool], str] = {}  # (W, transposed) → its float32 initializer
    gguf_bytes: dict[str, int] = {}  # W → its stored bytes

    def float_weight(node: onnx.NodeProto, transposed: bool) -> str:
        name = node.input[1]
        if name not in dense:
            if name not in stored:
                raise ValueError(f"{node.op_type} node {node.name!r}: its weight {name!r} is "
                                 "not an initializer of the graph")
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            layout = attrs.get("layout", ops.ROWS_LAYOUT)
            layout = layout.decode() if isinstance(layout, bytes) else layout
            rows = numpy_helper.to_array(stored[name])
            try:
                dense[name] = dequantise(rows, int(attrs["ggml_type"]), int(attrs["k"]),
                                         layout)
            except (NotImplementedError, ValueError) as exc:  # gguf lacks the type
                raise ValueError(
                    f"{node.op_type} node {node.name!r}: GGUF type {attrs['ggml_type']} "
                    f"cannot be dequantised here ({exc}); build the op library "
                    "(`make gguf-ops`) to serve this graph") from exc
            gguf_bytes[name] = rows.nbytes
        key = (name, transposed)
        if key not in floats:
            weights = np.ascontiguousarray(dense[name].T) if transposed else dense[name]
            floats[key] = f"{name}.dequantised{'.t' if transposed else ''}"  # .t: (K, N)
            graph.initializer.append(numpy_helper.from_array(weights, floats[key]))
        return floats[key]

    standard: list[onnx.NodeProto] = []
    half_caches = {v.name for v in graph.input
                   if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16}
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 17)
    for node in graph.node:
        if node.domain != ops.DOMAIN:
            standard.append(node)
        elif node.op_type == ops.MATMUL_OP:  # Y = X · Wᵀ
            weight = float_weight(node, transposed=True)
            if swiglu.is_swiglu(node):  # the product, then what the epilogue stands for
                products = f"{node.name}.products"
                standard.append(onnx.helper.make_node("MatMul", [node.input[0], weight],
                                                      [products], name=node.name))
                standard += swiglu.standard_nodes(products, node.output[0],
                                                  f"{node.name}.swiglu", opset)
            else:
                standard.append(onnx.helper.make_node("MatMul", [node.input[0], weight],
                                                      list(node.output), name=node.name))
        elif node.op_type == ops.GATHER_OP:  # Y = W[ids]
            weight = float_weight(node, transposed=False)
            standard.append(onnx.helper.make_node("Gather", [weight, node.input[0]],
                                                  list(node.output), name=node.name, axis=0))
        elif node.op_type == ops.SWIGLU_OP:  # silu(gate) · up of (..., 2F) gate | up
            standard += swiglu.standard_nodes(node.input[0], node.output[0], node.name, opset)
        elif node.op_type == ops.ATTENTION_OP:  # the same node, on ONNX Runtime's kernel
            node.op_type, node.domain = "GroupQueryAttention", CONTRIB
            standard += _float32_cache(node, half_caches)
        else:
            raise ValueError(f"node {node.name!r}: {node.op_type} of domain {ops.DOMAIN} has "
                             "no standard-op form")
    del graph.node[:]
    graph.node.extend(standard)
    used = {name for node in graph.node for name in node.input}
    gone = set(gguf_bytes) - used
    kept = [init for init in graph.initializer if init.name not in gone]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    imports = [o for o in proto.opset_import if o.domain != ops.DOMAIN]
    if any(n.domain == CONTRIB for n in graph.node) and all(o.domain != CONTRIB for o in imports):
        imports.append(onnx.helper.make_opsetid(CONTRIB, 1))
    del proto.opset_import[:]
    proto.opset_import.extend(imports)
    path = out_dir / "model.onnx"
    onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="weights.bin", size_threshold=1024)
    float_bytes = sum(dense[name].nbytes for name, _ in floats)
    return path, gone, sum(gguf_bytes.values()), float_bytes
