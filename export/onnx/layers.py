"""The nodes of every family's layers, chosen by the model's description.

model.onnx and attention.onnx (export/onnx/model_graphs.py) are standard ONNX operators
over (B, T, d) hidden states; the engine graphs (export/onnx/engine_graph.py) ONNX
Runtime's fused operators over flat (N, d) ones. What differs between families in either
(the norms, the feed-forward layer, the Q/K/V product, the embeddings and position
tables, the LM head) is written here once, for every family, from
:class:`~model.architectures.description.Description`, weights read from model.gpt.GPT's
modules by the attribute names every family shares (``ln_1``, ``attn.w_q``, ``ffn.up``,
...). Initializers are named the same in every graph, so onnx_build stores each once
(and a feed-forward weight ``l{i}.{module}.w`` after its ``ffn`` attribute, which
``--quantize gguf`` finds its GGUF blocks by).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from export.onnx.onnx_build import Graph, f32, stand_in
from model.architectures.description import Description

CONTRIB = "com.microsoft"  # ONNX Runtime's fused operators, for the engine graphs only
Activation = Callable[[Graph, str, str], str]  # (g, x, name) → act(x), standard operators


def _relu(g: Graph, x: str, name: str) -> str:
    return g.one("Relu", [x], name)


def _gelu(g: Graph, x: str, name: str, tanh: bool = False) -> str:
    """x · ½(1 + erf(x/√2)), exact; with ``tanh``, GPT-2's x · ½(1 + tanh(√(2/π)(x +
    0.044715x³)))."""
    half, one = g.const("half", np.array(0.5, np.float32)), g.const("one", np.array(
        1.0, np.float32))
    if not tanh:
        erf = g.one("Erf", [g.one("Div", [x, g.const("sqrt2", np.array(
            math.sqrt(2.0), np.float32))], f"{name}.scaled")], f"{name}.erf")
    else:
        cube = g.one("Mul", [g.one("Pow", [x, g.const("three", np.array(3.0, np.float32))],
                                   f"{name}.cube_raw"),
                             g.const("gelu_c", np.array(0.044715, np.float32))], f"{name}.cube")
        inner = g.one("Mul", [g.one("Add", [x, cube], f"{name}.poly"),
                              g.const("gelu_k", np.array(math.sqrt(2 / math.pi), np.float32))],
                      f"{name}.inner")
        erf = g.one("Tanh", [inner], f"{name}.tanh")
    gate = g.one("Add", [erf, one], f"{name}.gate")
    return g.one("Mul", [g.one("Mul", [x, gate], f"{name}.xg"), half], name)


def _silu(g: Graph, x: str, name: str) -> str:
    return g.one("Mul", [x, g.one("Sigmoid", [x], f"{name}.sig")], name)


# Description.activation → its nodes; a family with another activation adds an entry.
ACTIVATIONS: dict[str, Activation] = {
    "relu": _relu, "gelu": _gelu, "silu": _silu,
    "gelu_tanh": lambda g, x, name: _gelu(g, x, name, tanh=True)}


# -- model.onnx and attention.onnx: (B, T, ·), standard operators ---------------------------
def linear(g: Graph, x: str, weight: np.ndarray, bias: np.ndarray | None, name: str) -> str:
    """x·w (+ b) as MatMul (+ Add), which weight quantisation rewrites; w is (in, out)."""
    y = g.one("MatMul", [x, g.const(f"{name}.w", weight)], f"{name}.mm")
    if bias is not None:
        y = g.one("Add", [y, g.const(f"{name}.b", bias)], name)
    return y


def _module_linear(g: Graph, x: str, layer: Any, name: str) -> str:
    bias = None if layer.bias is None else f32(layer.bias)
    return linear(g, x, f32(layer.weight).T, bias, name)


def _norm_weights(g: Graph, form: Description, module: Any, name: str) -> list[str]:
    w = g.const(f"{name}.w", f32(module.weight))
    return [w, g.const(f"{name}.b", f32(module.bias))] if form.norm == "layer" else [w]


def norm(g: Graph, form: Description, x: str, module: Any, name: str) -> str:
    """LayerNorm; or RMSNorm w · x / sqrt(mean(x²) + ε), the pattern ORT fuses."""
    weights = _norm_weights(g, form, module, name)  # [w, b] or [w]
    if form.norm == "layer":
        return g.one("LayerNormalization", [x, *weights], name, axis=-1, epsilon=form.eps)
    var = g.one("ReduceMean", [g.one("Pow", [x, g.const("two", np.array(2.0, np.float32))],
                                     f"{name}.sq"), g.ints("axis_last", [-1])],
                f"{name}.var", keepdims=1)  # (B, T, 1)
    std = g.one("Sqrt", [g.one("Add", [var, g.const("rms_eps", np.array(form.eps, np.float32))],
                               f"{name}.var_eps")], f"{name}.std")
    return g.one("Mul", [weights[0], g.one("Div", [x, std], f"{name}.unit")],
                 name)  # (B, T, d)


def mlp(g: Graph, form: Description, h: str, ffn: Any, prefix: str) -> str:
    """The feed-forward layer of (B, T, d) → (B, T, d): down(act(up)), or gated
    down(act(gate) ⊙ up) (SwiGLU; GeGLU with gelu_tanh)."""
    p, act = prefix, ACTIVATIONS[form.activation]
    if form.mlp == "gated":
        gate = act(g, _module_linear(g, h, ffn.gate, f"{p}.gate"), f"{p}.act")
        hidden = g.one("Mul", [gate, _module_linear(g, h, ffn.up, f"{p}.up")], f"{p}.glu")
    else:
        hidden = act(g, _module_linear(g, h, ffn.up, f"{p}.up"), f"{p}.act")
    return _module_linear(g, hidden, ffn.down, f"{p}.down")


# -- the engine graphs: (N, d), ONNX Runtime's fused operators ------------------------------
def _affine(g: Graph, x: str, w: str, b: str | None, name: str, matmul_only: bool) -> str:
    """x·w (+ b): one Gemm, or MatMul + Add where weight quantisation must see the MatMul."""
    if b is None:
        return g.op("MatMul", [x, w], name)[0]
    if matmul_only:
        return g.op("Add", [g.op("MatMul", [x, w], f"{name}.mm")[0], b], name)[0]
    return g.op("Gemm", [x, w, b], name)[0]


def _engine_linear(g: Graph, x: str, layer: Any, name: str, bias: bool,
                   matmul_only: bool) -> str:
    w = g.const(f"{name}.w", f32(layer.weight).T)  # (in, out)
    b = g.const(f"{name}.b", f32(layer.bias)) if bias else None
    return _affine(g, x, w, b, name, matmul_only)


def fused_norm(g: Graph, form: Description, x: str, module: Any, name: str) -> str:
    """ONNX Runtime's LayerNormalization or SimplifiedLayerNormalization (RMS), (N, d)."""
    op = "LayerNormalization" if form.norm == "layer" else "SimplifiedLayerNormalization"
    return g.op(op, [x, *_norm_weights(g, form, module, name)], name, axis=-1,
                epsilon=form.eps)[0]


def skip_norm(g: Graph, form: Description, x: str, y: str, module: Any, bias: list[str],
              name: str, residual: str) -> tuple[str, str]:
    """(norm(x + y + bias), x + y + bias), named ``name`` and ``residual``: one fused node."""
    op = ("SkipLayerNormalization" if form.norm == "layer"
          else "SkipSimplifiedLayerNormalization")
    h, x = g.op(op, [x, y, *_norm_weights(g, form, module, name), *bias], name,
                outputs=[name, "", "", residual], domain=CONTRIB, epsilon=form.eps)[0::3]
    return h, x


def qkv_weight(attn: Any) -> np.ndarray:
    """Q | K | V projections side by side, (d, d + 2·kv): one MatMul for all three."""
    parts = [attn.w_q.weight, attn.w_k.weight, attn.w_v.weight]
    if any(p.is_meta for p in parts):  # from the file's blocks, all three (one tensor type)
        return stand_in((parts[0].shape[1], sum(p.shape[0] for p in parts)))
    return np.concatenate([f32(p).T for p in parts], axis=1)


def qkv_bias(attn: Any) -> np.ndarray | None:
    if attn.w_q.bias is None:
        return None
    return np.concatenate([f32(attn.w_q.bias), f32(attn.w_k.bias), f32(attn.w_v.bias)])


def fused_qkv(g: Graph, form: Description, h: str, attn: Any, prefix: str,
              matmul_only: bool) -> str:
    """q | k | v of flat hidden states, (N, nh·hs + 2·kv)."""
    w = g.const(f"{prefix}.w_qkv", qkv_weight(attn))
    bias = qkv_bias(attn) if form.qkv_bias else None
    b = None if bias is None else g.const(f"{prefix}.b_qkv", bias)
    return _affine(g, h, w, b, f"{prefix}.qkv", matmul_only)


def _biased_activation(g: Graph, form: Description, h: str, up: Any, prefix: str,
                       matmul_only: bool) -> str:
    """act(h·w_up + b_up) of the plain layer, the bias folded into ONNX Runtime's fused
    activation kernels where it has one."""
    p, kind = prefix, form.activation
    w = g.const(f"{p}.up.w", f32(up.weight).T)
    b = g.const(f"{p}.up.b", f32(up.bias))
    if kind == "relu" and not matmul_only:
        return g.op("FusedGemm", [h, w, b], f"{p}.up", domain=CONTRIB,
                    activation="Relu")[0]  # (N, d_ff)
    if kind in ("gelu", "gelu_tanh"):  # exact (erf), or GPT-2's tanh approximation
        product = g.op("MatMul", [h, w], f"{p}.up")[0]
        return g.op("FastGelu" if kind == "gelu_tanh" else "BiasGelu", [product, b],
                    f"{p}.act", domain=CONTRIB)[0]
    return ACTIVATIONS[kind](g, _affine(g, h, w, b, f"{p}.up", True), f"{p}.act")


def fused_mlp(g: Graph, form: Description, x: str, h: str, block: Any, next_norm: Any,
              prefix: str, next_name: str, matmul_only: bool,
              steer: str | None = None) -> tuple[str, str]:
    """The block's feed-forward layer of ``h`` added to the residual ``x``, then the next
    norm (the next block's first, or the final one): (normed, residual). The down
    projection's bias joins the skip norm, unless a post-norm (Gemma 3) comes first.
    ``steer`` (N, d), each token's control vector, joins the residual too: the block's
    output is x + mlp + steer, where llama.cpp adds it (model/steering.py)."""
    p, ffn = prefix, block.ffn
    if form.mlp == "gated":
        gate = _engine_linear(g, h, ffn.gate, f"{p}.gate", form.mlp_bias, matmul_only)
        act = (g.op("FastGelu", [gate], f"{p}.act", domain=CONTRIB)[0]
               if form.activation == "gelu_tanh" else
               ACTIVATIONS[form.activation](g, gate, f"{p}.act"))  # (N, d_ff)
        act = g.op("Mul", [act, _engine_linear(g, h, ffn.up, f"{p}.up", form.mlp_bias,
                                               matmul_only)], f"{p}.glu")[0]
    else:
        act = _biased_activation(g, form, h, ffn.up, p, matmul_only)  # (N, d_ff)
    down = g.op("MatMul", [act, g.const(f"{p}.down.w", f32(ffn.down.weight).T)],
                f"{p}.down")[0]  # (N, d)
    bias = [g.const(f"{p}.down.b", f32(ffn.down.bias))] if form.mlp_bias else []
    if form.post_norms:  # the MLP's output normed before the residual
        if bias:
            down = g.op("Add", [down, bias[0]], f"{p}.down_b")[0]
        down, bias = fused_norm(g, form, down, block.post_ffn, f"{p}.post_ffn"), []
    if steer is not None:
        down = g.op("Add", [down, steer], f"{p}.steered")[0]  # (N, d)
    return skip_norm(g, form, x, down, next_norm, bias, next_name, f"{p}.res2")


def position_tables(g: Graph, form: Description, gpt: Any
                    ) -> tuple[tuple[str, str] | None, tuple[str, str] | None]:
    """Declared first: the (cos, sin) tables GroupQueryAttention rotates Q and K with
    (the model's, and the window layers' of their own base or None); or, for table
    positions, the token and position tables the embedding gathers (None, None)."""
    if not form.rotary:
        g.const("tok_emb", f32(gpt.tok_emb.weight))  # (V, d)
        table: Any = gpt.pos_emb.weight if gpt.pos_emb is not None else gpt.pos_table
        g.const("pos_emb", f32(table))  # (L, d)
        return None, None
    every = _tables(g, gpt.rotary, form.max_seq_len, "rope")
    return every, None if gpt.rotary_local is None else _tables(
        g, gpt.rotary_local, form.max_seq_len, "rope_local")


def _tables(g: Graph, rotary: Any, length: int, name: str) -> tuple[str, str]:
    """cos/sin of ``length`` rows as model/rotary.py computes them, (L, rd/2) each, times
    LongRoPE's attention factor (1 elsewhere): GroupQueryAttention's rotary caches."""
    with torch.no_grad():
        angles = (torch.arange(length)[:, None].float() * rotary.inv_freq).numpy()  # (L, rd/2)
    # numpy's cos and sin, on one thread: once, an export's engine.onnx got a cos table
    # whose rows past 4096 (the second of PyTorch's two threads' halves) were up to 1.5e-4
    # off, its engine_mixed.onnx the right one; not seen again in thousands of calls
    scale = np.float32(rotary.scale)
    return (g.const(f"{name}.cos", np.cos(angles) * scale),  # (L, rd/2)
            g.const(f"{name}.sin", np.sin(angles) * scale))  # (L, rd/2)


def embed(g: Graph, form: Description, gpt: Any, input_ids: str, position_ids: str) -> str:
    """Token embeddings (plus the position table's rows, or times Gemma's √d), (B, T, d)."""
    x = g.op("Gather", [g.const("tok_emb", f32(gpt.tok_emb.weight)), input_ids],
             "tok_gather")[0]  # (B, T, d)
    if not form.rotary:
        x = g.op("Add", [x, g.op("Gather", ["pos_emb", position_ids], "pos_gather")[0]],
                 "embed")[0]
    if form.embed_scale is not None:
        x = g.op("Mul", [x, g.const("embed_scale", np.array(form.embed_scale, np.float32))],
                 "embed")[0]
    return x


# -- both -----------------------------------------------------------------------------------
def lm_head(g: Graph, form: Description, gpt: Any, h: str, matmul: bool) -> str:
    """Logits (N, V) of flat hidden states (N, d): Gemm(transB=1) over the (V, d) head,
    for a tied model the embedding matrix itself (stored once); a MatMul over its transpose
    where weight quantisation must see one (it rewrites MatMul nodes only)."""
    head = f32(gpt.lm_head.weight)  # (V, d): a tied model's embedding bytes
    if matmul:
        return g.one("MatMul", [h, g.const("lm_head.w", head.T)], "lm_head")
    name = "tok_emb" if form.tied_head else "lm_head.weight"
    return g.one("Gemm", [h, g.const(name, head)], "lm_head", transB=1)
