"""``--quantize int8-dynamic`` with the activations quantised row by row, so a row's
logits never depend on which other rows share its batch.

``quantize_dynamic`` quantises each MatMul's input through ``DynamicQuantizeLinear``: one
scale and zero point for the whole (B, T, d) tensor, taken from its minimum and maximum.
Under continuous batching a prompt's logits then moved when another prompt joined (by
more than 1e-3 on the tiny test model), and a greedy token near a tie could flip. Here
each ``DynamicQuantizeLinear`` computes the same thing per row (per token: the last axis),
as llama.cpp quantises activations per block of a row:

    lo, hi = min(min x, 0), max(max x, 0)        over the row: (B, T, 1)
    scale  = (hi − lo) / 255
    zp     = round(−lo / scale)                  0..255
    q      = saturate(round(x / scale) + zp)     uint8 (QuantizeLinear along the rows)

ONNX Runtime's MatMulInteger takes one zero point for A only, so each product reading q
runs with zero point 0 and takes the rows' own back in int32, exactly:
Σ_k (q − zp)(w − w_zp) = Σ_k q (w − w_zp) − zp · colsum, colsum_n = Σ_k (w_kn − w_zp_n)
computed here from the product's int8 weights. The node's outputs and the product's keep
their names, so ``quantize_dynamic``'s Cast and Mul by ``x_scale · w_scale`` are
untouched: that product now broadcasts (B, T, 1) × (N,) to each row's own scale. A row of
zeros gets the smallest normal float as its range, so it quantises to 0 and so does its
product.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

TOP = 255  # uint8 codes 0..255


def per_row_activations(model: onnx.ModelProto) -> int:
    """Rewrite every DynamicQuantizeLinear of ``model`` in place; how many there were."""
    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 18)
    weights = {t.name: t for t in graph.initializer}
    dynamic = {n.output[0]: n for n in graph.node if n.op_type == "DynamicQuantizeLinear"
               and n.domain in ("", "ai.onnx")}  # quantised name → its node
    if not dynamic:
        return 0
    constants = [numpy_helper.from_array(np.array(v, np.float32), f"rows.{name}")
                 for name, v in (("zero", 0.0), ("top", float(TOP)),
                                 ("tiny", np.finfo(np.float32).tiny))]
    constants.append(numpy_helper.from_array(np.array(0, np.uint8), "rows.no_zero_point"))
    # the last axis (ReduceMin/Max's axes), or a shape of one axis (Reshape's)
    constants.append(numpy_helper.from_array(np.array([-1], np.int64), "rows.minus_one"))
    # a zero point read by anything but the products rewritten below stays a tensor (0)
    read_elsewhere = {name for n in graph.node if not (
        n.op_type == "MatMulInteger" and n.input[0] in dynamic) for name in n.input}
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.output[0] in dynamic and node.op_type == "DynamicQuantizeLinear":
            nodes += _quantise_rows(node, opset, node.output[2] in read_elsewhere)
        elif node.op_type == "MatMulInteger" and node.input[0] in dynamic:
            nodes += _zero_points_back(node, dynamic[node.input[0]], weights, constants)
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(constants)
    # shapes recorded for the rewritten tensors (a scalar scale) no longer hold
    rewritten = {o for n in dynamic.values() for o in n.output}
    kept = [v for v in graph.value_info if v.name not in rewritten]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    return len(dynamic)


def _reduce(op: str, x: str, out: str, opset: int) -> onnx.NodeProto:
    """``op`` over the last axis, kept: (..., 1). Axes became an input at opset 18."""
    if opset >= 18:
        return helper.make_node(op, [x, "rows.minus_one"], [out], name=out, keepdims=1)
    return helper.make_node(op, [x], [out], name=out, keepdims=1, axes=[-1])


def _quantise_rows(node: onnx.NodeProto, opset: int, zero_point_read: bool
                   ) -> list[onnx.NodeProto]:
    """DynamicQuantizeLinear's arithmetic with a range per row. The products take zero
    point 0 (its zero-point output is that 0 where ``zero_point_read``); the rows' own zero
    points are ``{q}.rows.zp_int`` (int32, (..., 1))."""
    (x,), (quantized, scale, zero_point) = node.input, node.output
    p = f"{quantized}.rows"

    def op(kind: str, inputs: list[str], out: str, **attrs: Any) -> onnx.NodeProto:
        return helper.make_node(kind, inputs, [out], name=out, **attrs)

    return [
        _reduce("ReduceMin", x, f"{p}.min", opset),
        _reduce("ReduceMax", x, f"{p}.max", opset),
        op("Min", [f"{p}.min", "rows.zero"], f"{p}.lo"),  # the range holds 0
        op("Max", [f"{p}.max", "rows.zero"], f"{p}.hi"),
        op("Sub", [f"{p}.hi", f"{p}.lo"], f"{p}.span"),
        op("Max", [f"{p}.span", "rows.tiny"], f"{p}.range"),
        op("Div", [f"{p}.range", "rows.top"], scale),  # (..., 1)
        op("Div", [f"{p}.lo", scale], f"{p}.lo_codes"),
        op("Neg", [f"{p}.lo_codes"], f"{p}.neg_lo"),
        op("Round", [f"{p}.neg_lo"], f"{p}.zp"),  # 0..255: -lo <= hi - lo = 255 · scale
        # QuantizeLinear per row: the rows flattened to (rows, d), their scales and zero
        # points to (rows,) along axis 0, the codes shaped back as x
        op("Flatten", [x], f"{p}.flat", axis=-1),
        op("Reshape", [scale, "rows.minus_one"], f"{p}.scales"),
        op("Cast", [f"{p}.zp"], f"{p}.zp_u8", to=onnx.TensorProto.UINT8),
        op("Reshape", [f"{p}.zp_u8", "rows.minus_one"], f"{p}.zero_points"),
        op("QuantizeLinear", [f"{p}.flat", f"{p}.scales", f"{p}.zero_points"],
           f"{p}.codes", axis=0),
        op("Shape", [x], f"{p}.shape"),
        op("Reshape", [f"{p}.codes", f"{p}.shape"], quantized),
        op("Cast", [f"{p}.zp"], f"{p}.zp_int", to=onnx.TensorProto.INT32),
        *([op("Identity", ["rows.no_zero_point"], zero_point)] if zero_point_read else []),
    ]


def _zero_points_back(node: onnx.NodeProto, source: onnx.NodeProto,
                      weights: dict[str, onnx.TensorProto],
                      constants: list[onnx.TensorProto]) -> list[onnx.NodeProto]:
    """The product with zero point 0, less each row's zero point times the weights'
    column sums (int32, exact), under the product's own output name."""
    inputs = [*node.input, "", ""]
    quantized, w, w_zero_point = inputs[0], inputs[1], inputs[3]
    if w not in weights or (w_zero_point and w_zero_point not in weights):
        raise ValueError(f"MatMulInteger {node.name!r}: its weights are not constants")
    codes = numpy_helper.to_array(weights[w]).astype(np.int64)  # (K, N)
    if w_zero_point:
        codes = codes - numpy_helper.to_array(weights[w_zero_point]).astype(np.int64)
    colsum = codes.sum(axis=0)  # (N,); |Σ| <= K·255, far inside int32
    out = node.output[0]
    p = f"{out}.rows"
    constants.append(numpy_helper.from_array(colsum.astype(np.int32), f"{p}.colsum"))
    raw = helper.make_node("MatMulInteger", [quantized, w, "rows.no_zero_point",
                                             *([w_zero_point] if w_zero_point else [])],
                           [f"{p}.raw"], name=node.name or f"{p}.raw")
    return [
        raw,
        helper.make_node("Mul", [f"{source.output[0]}.rows.zp_int", f"{p}.colsum"],
                         [f"{p}.shift"], name=f"{p}.shift"),  # (..., N)
        helper.make_node("Sub", [f"{p}.raw", f"{p}.shift"], [out], name=f"{p}.Sub"),
    ]
