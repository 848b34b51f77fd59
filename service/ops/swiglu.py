"""GgufMatMul's ``epilogue="swiglu"`` spelled out, for the graphs that need the unfused form:
the adapter graphs, which add LoRA updates to gate and up before the activation
(export/lora/adapter_graph.py: a Split, then the library's own Swiglu op over the two
halves joined again, so that a row without an adapter computes what the fused graph
computes, bit for bit), and the dequantised copy served without the op library
(dequantised.py: standard ops).

The export fuses only a node named ``"<gate>+<up>"`` whose Split wrote ``<gate>`` and
``<up>`` (export/gguf/blocks.py), so those names come back here as they were."""

from __future__ import annotations

from typing import Any

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


def _halves(x: str, outputs: list[str], name: str, opset: int) -> Any:
    """A Split of ``x``'s last axis into two equal halves: from opset 18 by ``num_outputs``,
    before by the outputs' count."""
    from onnx import helper

    split = helper.make_node("Split", [x], outputs, name=name, axis=-1)
    if opset >= 18:
        split.attribute.append(helper.make_attribute("num_outputs", 2))
    return split


def tail_nodes(node: Any, products: str, opset: int) -> list[Any]:
    """What follows the gate | up products (``products``, (..., rows)) in place of the
    epilogue, in the adapter graphs: a Split into halves named as the export's Split named
    them, then the halves joined and the library's Swiglu op, written to the fused node's
    output."""
    from onnx import helper

    gate, up = halves_of(node)
    p = node.name
    return [_halves(products, [gate, up], f"{p}.gguf_split", opset),
            helper.make_node("Concat", [gate, up], [f"{p}.gate_up"], name=f"{p}.gate_up",
                             axis=-1),
            helper.make_node(ops.SWIGLU_OP, [f"{p}.gate_up"], list(node.output),
                             name=f"{p}.swiglu", domain=ops.DOMAIN)]


def standard_nodes(x: str, out: str, name: str, opset: int) -> list[Any]:
    """The Swiglu op as standard ops, for a graph served without the library: ``x`` (...,
    2F) split into halves, silu(gate) = gate · Sigmoid(gate), times up, into ``out``."""
    from onnx import helper

    return [_halves(x, [f"{name}.gate", f"{name}.up"], f"{name}.split", opset),
            helper.make_node("Sigmoid", [f"{name}.gate"], [f"{name}.sigmoid"],
                             name=f"{name}.sigmoid"),
            helper.make_node("Mul", [f"{name}.gate", f"{name}.sigmoid"], [f"{name}.silu"],
                             name=f"{name}.silu"),
            helper.make_node("Mul", [f"{name}.silu", f"{name}.up"], [out], name=name)]
