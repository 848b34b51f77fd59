"""GgufMatMul's ``epilogue="swiglu"`` spelled out in standard ops, for the graphs that need
the unfused form: the dequantised copy served without the op library (dequantised.py) and
the adapter graphs, which add LoRA updates to gate and up before the activation
(export/lora/adapter_graph.py).

The export fuses only a node named ``"<gate>+<up>"`` whose Split wrote ``<gate>`` and
``<up>`` (export/gguf/blocks.py), so those names come back here as they were."""

from __future__ import annotations

from typing import Any

import numpy as np

from service import ops


def is_swiglu(node: Any) -> bool:
    """Whether ``node`` is a GgufMatMul with ``epilogue="swiglu"``."""
    if node.op_type != ops.MATMUL_OP or node.domain != ops.DOMAIN:
        return False
    for attribute in node.attribute:
        if attribute.name == "epilogue":
            return bool(attribute.s.decode() == ops.SWIGLU_EPILOGUE)
    return False


def halves_of(node: Any) -> tuple[str, str]:
    """The gate and up outputs the fused node's Split wrote: its name's two parts, or (for
    a node named otherwise) ``<name>.gate`` and ``<name>.up``."""
    parts = node.name.split("+")
    return (parts[0], parts[1]) if len(parts) == 2 else (f"{node.name}.gate", f"{node.name}.up")


def halves_const(rows: int, name: str) -> Any:
    """The Split's sizes, [rows / 2, rows / 2], as an initializer named ``name``."""
    from onnx import numpy_helper

    return numpy_helper.from_array(np.array([rows // 2, rows // 2], np.int64), name)


def tail_nodes(node: Any, products: str, halves: str) -> list[Any]:
    """What follows the gate | up products (``products``, (..., rows)) in place of the
    epilogue: a Split into halves (``halves``: their sizes), silu(gate) = gate ·
    Sigmoid(gate), and its product with up, written to the fused node's output."""
    from onnx import helper

    gate, up = halves_of(node)
    p = node.name
    return [helper.make_node("Split", [products, halves], [gate, up], name=f"{p}.gguf_split",
                             axis=-1),
            helper.make_node("Sigmoid", [gate], [f"{p}.sigmoid"], name=f"{p}.sigmoid"),
            helper.make_node("Mul", [gate, f"{p}.sigmoid"], [f"{p}.silu"], name=f"{p}.silu"),
            helper.make_node("Mul", [f"{p}.silu", up], list(node.output), name=f"{p}.swiglu")]
