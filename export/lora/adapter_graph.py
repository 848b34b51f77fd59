"""The adapter graphs: an engine graph (or attention.onnx) with LoRA updates added per row.

A rewrite of a graph export has already built (and quantised: MatMulNBits or GGUF blocks
change nothing here), loaded without its weights: beside every projection output ``y``
a LoRA target adapts, the update

    ((x·Aᵀ) ⊙ lora_mask)·B        x (N, in), A (S·R, in), mask (N, S·R), B (S·R, out)

is added, every slot's rows at once with each token's other slots masked away (the names
and their meaning: service/contract/adapter_spec.py). The producer's output is renamed
and ``Add(base, update)`` takes the old name, so every consumer (the split into Q | K | V,
the SiLU, the skip norm) reads the adapted value and nothing else moves. ``x`` is found
from the producer itself (through a bias Add, a GGUF product's remainder Gemm, Concat or
Split of block formats), so the same rewrite serves float32 and quantised graphs. GPT-2's
ReLU MLP, one FusedGemm with the activation folded in, is split back into Gemm and Relu
with the update between them.

Where one projection output holds several modules' columns (our fused ``l{i}.qkv`` from
q_proj, k_proj and v_proj) their updates are concatenated in column order and added once;
where one module spans several outputs (Phi-3's gate_up_proj over gate and up) its update
is split. The engine graphs' hidden states are flat (N, d): ``Gemm(x, A, transB=1)``;
attention.onnx's are (1, T, d): ``MatMul(x, Transpose(A))``. No weight is copied: the
result points into the same weights.bin, only small shape constants are inline.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from model.architectures import architecture
from model.architectures.base import LoRATarget
from service.contract import io_spec as io
from service.contract.adapter_spec import LORA_MASK, lora_a, lora_b, lora_file
from service.contract.engine_spec import ENGINE_FILE, ENGINE_MIXED_FILE, SEQLENS_K
from service.ops import swiglu

TOKENS, ROWS = "lora_tokens", "lora_rows"  # N and S·R: symbolic dimensions of the inputs
# the graphs export writes an adapter graph beside, when the artifact has them
ADAPTED_FILES = (ENGINE_FILE, ENGINE_MIXED_FILE, io.ATTENTION_FILE)
_PRODUCTS = ("MatMul", "MatMulNBits", "GgufMatMul", "FusedGemm")


def _columns(cfg: Any) -> dict[str, tuple[str, int]]:
    """Our layer (``attn.w_k``) → (the graph's projection output, its first column)."""
    width, kv = cfg.attention_width, cfg.kv_heads * cfg.head_dim
    return {"attn.w_q": ("qkv", 0), "attn.w_k": ("qkv", width), "attn.w_v": ("qkv", width + kv),
            "attn.w_o": ("o", 0), "ffn.gate": ("gate", 0), "ffn.up": ("up", 0),
            "ffn.down": ("down", 0)}


def part_widths(target: LoRATarget, cfg: Any) -> list[tuple[int, int]]:
    """(in, out) of each of our layers a target adapts, in row order."""
    from model.finetune.peft_format import _layer_widths

    return [_layer_widths(LoRATarget(target.module, (ours,)), cfg) for ours in target.ours]


def target_widths(target: LoRATarget, cfg: Any) -> tuple[int, int]:
    """(in, out) of a target: what its A and B inputs are wide."""
    parts = part_widths(target, cfg)
    return parts[0][0], sum(out for _, out in parts)


class _Rewrite:
    """The new nodes and where each goes: after the node that makes what it reads first."""

    def __init__(self, model: onnx.ModelProto, flat: bool) -> None:
        self.graph = model.graph
        self.flat = flat
        self.inits = {t.name for t in self.graph.initializer}
        self.producer = {out: (j, node) for j, node in enumerate(self.graph.node)
                         for out in node.output if out}
        self.after: dict[int, list[onnx.NodeProto]] = {}  # node index (-1: first) → new nodes
        self.consts: list[onnx.TensorProto] = []

    def output(self, name: str) -> str | None:
        """The projection output ``name`` (attention.onnx names a bias-less one ``.mm``)."""
        return next((n for n in (name, f"{name}.mm") if n in self.producer), None)

    def source(self, y: str) -> str:
        """The input ``x`` of the weight product that makes ``y``."""
        _, node = self.producer[y]
        op = node.op_type
        if op == "FusedGemm" and _activation(node) not in (None, "Relu"):
            raise ValueError(f"{y} is a product with {_activation(node)} fused in (FusedGemm)")
        if op in _PRODUCTS:
            return str(node.input[0])
        if op == "Gemm":  # a GGUF product's remainder: Gemm(block sums, mins, main product)
            c = node.input[2] if len(node.input) > 2 else ""
            return self.source(c) if c in self.producer else str(node.input[0])
        if op == "Add":  # a bias (or a remainder) after the product
            made = [i for i in node.input if i in self.producer and i not in self.inits]
            if made:
                return self.source(made[0])
        if op in ("Concat", "Split"):  # a GGUF product split or joined by block format
            return self.source(node.input[0])
        raise ValueError(f"{y} is made by {op}, not a weight product")

    def emit(self, after: str, op: str, inputs: list[str], name: str,
             outputs: list[str] | None = None, **attrs: Any) -> list[str]:
        """A node placed after the producer of ``after`` (first, for a graph input)."""
        outs = outputs or [name]
        at = self.producer[after][0] if after in self.producer else -1
        self.after.setdefault(at, []).append(
            helper.make_node(op, inputs, outs, name=name, **attrs))
        return outs

    def const(self, name: str, value: np.ndarray) -> str:
        self.consts.append(numpy_helper.from_array(value, name))
        return name

    def update(self, module: str, x: str) -> str:
        """((x·Aᵀ) ⊙ mask)·B of one module: (N, out), or (1, T, out) for (1, T, in)."""
        a, p = lora_a(module), f"lora.{module}"
        if self.flat:
            low = self.emit(x, "Gemm", [x, a], f"{p}.xa", transB=1)[0]  # (N, S·R)
        else:
            at = self.emit(x, "Transpose", [a], f"{p}.at", perm=[1, 0])[0]  # (in, S·R)
            low = self.emit(x, "MatMul", [x, at], f"{p}.xa")[0]  # (1, T, S·R)
        masked = self.emit(x, "Mul", [low, LORA_MASK], f"{p}.masked")[0]  # each row its slot
        return self.emit(x, "MatMul", [masked, lora_b(module)], f"{p}.update")[0]  # (N, out)

    def add(self, y: str, updates: list[str]) -> None:
        """y ← y + (the updates side by side): the producer's output renamed."""
        _, node = self.producer[y]
        base = f"{y}.base"
        node.output[list(node.output).index(y)] = base
        update = updates[0] if len(updates) == 1 else self.emit(
            y, "Concat", updates, f"{y}.lora_updates", axis=-1)[0]
        if _activation(node) is None:
            self.emit(y, "Add", [base, update], f"{y}.lora", outputs=[y])
            return
        # GPT-2's ReLU MLP: FusedGemm(x, W, b) with its ReLU → Gemm, the update, then ReLU
        kept = [a for a in node.attribute if a.name in ("alpha", "beta", "transA", "transB")]
        node.op_type, node.domain = "Gemm", ""
        del node.attribute[:]
        node.attribute.extend(kept)
        adapted = self.emit(y, "Add", [base, update], f"{y}.lora", outputs=[f"{y}.adapted"])
        self.emit(y, "Relu", adapted, f"{y}.relu", outputs=[y])

    def finish(self) -> None:
        nodes = list(self.after.get(-1, []))
        for j, node in enumerate(self.graph.node):
            nodes += [node, *self.after.get(j, [])]
        del self.graph.node[:]
        self.graph.node.extend(nodes)
        self.graph.initializer.extend(self.consts)


def _unfuse_swiglu(model: onnx.ModelProto) -> None:
    """Each GgufMatMul with the SwiGLU epilogue (export/gguf/blocks.py) back to its gate |
    up product and the Split into gate and up, then the halves joined into the library's
    Swiglu op, the epilogue's own code (service/ops/swiglu.py)."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        if not swiglu.is_swiglu(node):
            nodes.append(node)
            continue
        product = onnx.NodeProto()
        product.CopyFrom(node)
        del product.output[:]
        product.output.append(f"{node.name}.gguf_joined")
        kept = [a for a in product.attribute if a.name != "epilogue"]
        del product.attribute[:]
        product.attribute.extend(kept)
        nodes += [product, *swiglu.tail_nodes(node, product.output[0], opset)]
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def _activation(node: onnx.NodeProto) -> str | None:
    """The activation a FusedGemm applies to its product; None for any other node."""
    if node.op_type != "FusedGemm":
        return None
    return next((a.s.decode() for a in node.attribute if a.name == "activation"), None)


def build_adapter_graph(model: onnx.ModelProto, cfg: Any) -> onnx.ModelProto:
    """The adapter graph of ``model`` (engine.onnx, engine_mixed.onnx or attention.onnx,
    loaded with ``load_external_data=False``), a copy; ``cfg`` the model's GPTConfig.
    ValueError (one line) where the graph's projections are not plain products."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    names = {i.name for i in out.graph.input}
    # a float16 graph's weights are float16 (a float16 KV cache alone, over the GGUF ops, is
    # no obstacle: the updates are products of float32 activations)
    if any(t.data_type == TensorProto.FLOAT16 for t in out.graph.initializer):
        raise ValueError("no adapter graph for a float16 graph (its activations are float16)")
    flat = SEQLENS_K in names  # the engine graphs: (N, d); attention.onnx: (1, T, d)
    _unfuse_swiglu(out)  # the updates go to gate and up, before the activation
    rewrite = _Rewrite(out, flat)
    targets = architecture(cfg.arch).lora_targets(cfg)
    columns = _columns(cfg)
    # graph output → [(first column, width, update)], every part of every module
    pieces: dict[str, list[tuple[int, int, str]]] = {}
    try:
        for target in targets:
            layer = target.ours[0].split(".")[1]  # blocks.<layer>.attn.w_q
            spans: list[tuple[str, int, int]] = []  # (graph output, first column, width)
            for name, (_, width) in zip(target.ours, part_widths(target, cfg), strict=True):
                key, start = columns[name.split(".", 2)[2]]
                y = rewrite.output(f"l{layer}.{key}")
                if y is None:
                    if flat:
                        raise ValueError(f"no projection output l{layer}.{key} in the graph")
                    break  # attention.onnx stops at the last layer's attention
                if spans and spans[-1][0] == y and spans[-1][1] + spans[-1][2] == start:
                    spans[-1] = (y, spans[-1][1], spans[-1][2] + width)  # q | k | v of c_attn
                else:
                    spans.append((y, start, width))
            else:
                xs = {rewrite.source(y) for y, _, _ in spans}
                if len(xs) != 1:
                    raise ValueError(f"{target.module}'s projections read {sorted(xs)}")
                x = xs.pop()
                update = rewrite.update(target.module, x)
                if len(spans) > 1:  # one module over several outputs: its columns split
                    sizes = rewrite.const(f"lora.{target.module}.split",
                                          np.array([w for _, _, w in spans], np.int64))
                    parts = rewrite.emit(x, "Split", [update, sizes],
                                         f"lora.{target.module}.parts",
                                         outputs=[f"lora.{target.module}.part{k}"
                                                  for k in range(len(spans))], axis=-1)
                else:
                    parts = [update]
                for (y, start, width), part in zip(spans, parts, strict=True):
                    pieces.setdefault(y, []).append((start, width, part))
    except ValueError as exc:
        raise ValueError(f"no adapter graph for this {cfg.arch} model: {exc}") from exc
    for y, found in pieces.items():
        found.sort()
        ends = [0] + [start + width for start, width, _ in found[:-1]]
        if [start for start, _, _ in found] != ends:  # the updates must tile the columns
            raise ValueError(f"no adapter graph for this {cfg.arch} model: {y}'s columns "
                             f"are adapted by no module or by two")
        rewrite.add(y, [update for _, _, update in found])
    rewrite.finish()
    graph = out.graph
    graph.input.append(helper.make_tensor_value_info(LORA_MASK, TensorProto.FLOAT,
                                                     [TOKENS, ROWS]))
    for target in targets:
        width_in, width_out = target_widths(target, cfg)
        graph.input.extend([
            helper.make_tensor_value_info(lora_a(target.module), TensorProto.FLOAT,
                                          [ROWS, width_in]),
            helper.make_tensor_value_info(lora_b(target.module), TensorProto.FLOAT,
                                          [ROWS, width_out])])
    out.doc_string = (out.doc_string + " With LoRA adapters per row: lora_mask, lora.<module>"
                      ".A/B (export/lora/adapter_graph.py).").strip()
    return out


def write_adapter_graphs(directory: Path, cfg: Any, files: Sequence[str] = ADAPTED_FILES,
                         suffix: str = "") -> list[Path]:
    """The adapter graph of each of ``files`` the directory holds, over its weights.bin,
    as ``<stem>_lora.onnx`` (+ ``suffix``: a copy to check); all of them or, where one
    cannot be built (ValueError), none. The paths written."""
    built = {directory / f"{lora_file(name)}{suffix}": build_adapter_graph(
        onnx.load(str(directory / name), load_external_data=False), cfg)
        for name in files if (directory / name).is_file()}
    for path, model in built.items():
        onnx.save_model(model, str(path))
    return list(built)
