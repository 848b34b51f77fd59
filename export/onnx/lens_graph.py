"""attention.onnx's look-inside nodes: logit lens, residual norms and direct logit attribution.

Written into attention.onnx rather than a graph beside it: the service cuts a graph down to
the outputs a request fetches (service/viz/graph_cut.py), so these nodes cost nothing to a
request for the attention maps, and one request for both runs the decoder once. ONNX
Runtime itself does not prune: on SmolLM2 at 128 tokens, fetching the 180 map outputs took
9.7 s from the whole graph and 1.0 s from the graph cut to them (one thread), so a caller
that runs the whole graph (the export's own check of the maps) pays for the lens too. The
names are service/contract/lens_spec.py's.

The lens puts each layer's residual through the final norm and the graph's own LM head node
(one product per layer: all layers at once would hold L·T·V logits, 3 GB for SmolLM2 at 512
tokens); TopK takes k as an input, and probabilities are exp(logit − logsumexp), exact over
the whole vocabulary.

Attribution follows TransformerLens' ``decompose_resid`` / direct logit attribution: the
final residual at the chosen position is a sum of components (the embedding, each head's
output through its slice of o_proj, the biases, each MLP's output); the final norm is
linearised with the scale of the whole residual (RMS, or LayerNorm's standard deviation),
that one scale divides every component, and LayerNorm also centres each; each is then put
through the LM head and read at the target. With the norm's β as one more term the terms
sum to the logit. A control vector (the ``steer`` input) is one more component per layer,
its row added after the block. A head's output is its z placed in its slice of an otherwise zero
(nh, W) block through o_proj's own weight, so the weight's layout is o_proj's. Gemma 3's
post-attention norm is linearised the same way (the scale of the whole attention output
divides each head's); its post-MLP norm needs none (the MLP is one term).

Both products read the weights by the names o_proj and the LM head store them under, so
weight quantisation rewrites them as it rewrites those (MatMulNBits, the GGUF blocks' ops:
seen on int4 and GGUF exports, the terms still summing to the graph's own logit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from export.onnx import layers
from export.onnx.onnx_build import Graph, f32
from model.architectures.description import Description
from service.contract import io_spec as io
from service.contract import lens_spec as lens


@dataclass(frozen=True)
class LayerTaps:
    """Values of one block the look-inside nodes read, by graph name."""

    merged: str  # the heads' outputs side by side, o_proj's input (B, T, W)
    attention: str  # o_proj's output with its bias, before any post norm (B, T, d)
    mlp: str  # the MLP's output as the residual adds it (post-normed under Gemma 3)
    residual: str  # the residual stream after the block, steered (B, T, d)
    steer: str | None = None  # the control vector's row added after the block (d,)


def declare_inputs(g: Graph) -> None:
    """The inputs with their defaults, as initializers of the same names."""
    for name, value in lens.INPUT_DEFAULTS.items():
        g.ints(name, [value])


def write(g: Graph, form: Description, gpt: Any, embedded: str, taps: list[LayerTaps]
          ) -> list[str]:
    """Every lens_spec output, from the builder's taps; returns their names."""
    table = f32(gpt.lm_head.weight)  # (V, d), made once (the graph stores it once)
    names, last_normed = _lens(g, form, gpt, table, taps)
    return [*_norms(g, taps), *names,
            *_attribution(g, form, gpt, table, embedded, taps, last_normed)]


def _norms(g: Graph, taps: list[LayerTaps]) -> list[str]:
    names: list[str] = []
    for i, tap in enumerate(taps):
        name = lens.residual_norm_name(i)
        g.op("ReduceL2", [tap.residual, g.ints("axis_last", [-1])], f"{name}.l2",
             outputs=[name], keepdims=0)  # (B, T)
        names.append(name)
    return names


def _lens(g: Graph, form: Description, gpt: Any, table: np.ndarray, taps: list[LayerTaps]
          ) -> tuple[list[str], str]:
    """Per layer: top-k ids and probabilities, the target's probability and rank; and the
    last layer's normed residual (B, T, d), what the LM head reads."""
    n = len(taps)
    stacked = g.one("Concat", [t.residual for t in taps], "lens.residuals", axis=0)  # (L·B, T, d)
    normed = layers.norm(g, form, stacked, gpt.ln_f, "ln_f")  # (L·B, T, d)
    per_layer = g.op("Split", [normed], "lens.split", n_out=n, axis=0,
                     num_outputs=n) if n > 1 else [normed]
    shape_k = g.one("Concat", ["ids_shape", g.ints("minus1", [-1])], "shape_bt_any", axis=0)
    names: list[str] = []
    for i, h in enumerate(per_layer):
        p = f"lens.{i}"
        flat = g.one("Reshape", [h, g.ints("shape_flat", [-1, form.d_model])], f"{p}.flat")
        logits = _head(g, form, table, flat, f"{p}.logits")  # (N, V)
        lse = g.one("ReduceLogSumExp", [logits, "axis_last"], f"{p}.lse", keepdims=1)  # (N, 1)
        values, ids = g.op("TopK", [logits, lens.TOP_K], f"{p}.topk", n_out=2, axis=-1,
                           largest=1, sorted=1)  # (N, k)
        probs = g.one("Exp", [g.one("Sub", [values, lse], f"{p}.top_logp")], f"{p}.top_p")
        target = g.one("Gather", [logits, lens.TARGET], f"{p}.target_logit", axis=1)  # (N, 1)
        t_prob = g.one("Exp", [g.one("Sub", [target, lse], f"{p}.target_logp")], f"{p}.t_p")
        above = g.one("Cast", [g.one("Greater", [logits, target], f"{p}.above")],
                      f"{p}.above_i", to=7)  # int64
        rank = g.one("ReduceSum", [above, "axis_last"], f"{p}.rank", keepdims=1)  # (N, 1)
        for kind, value, shape in (("top_ids", ids, shape_k), ("top_probs", probs, shape_k),
                                   ("target_prob", t_prob, "ids_shape"),
                                   ("target_rank", rank, "ids_shape")):
            name = lens.lens_output_name(i, kind)
            g.op("Reshape", [value, shape], f"{name}.shaped", outputs=[name])
            names.append(name)
    return names, per_layer[-1]


def _head(g: Graph, form: Description, table: np.ndarray, h: str, name: str) -> str:
    """Logits (N, V) of (N, d) by the LM head's weight, as model.onnx's head node reads it
    (layers.lm_head: the (V, d) head, a tied model's embedding table), in a node of its
    own name: attention.onnx holds one per layer."""
    weight = "tok_emb" if form.tied_head else "lm_head.weight"
    return g.one("Gemm", [h, g.const(weight, table)], name, transB=1)


def _at(g: Graph, x: str, name: str) -> str:
    """x (B, T, ·) at the attribution position: (B, 1, ·)."""
    return g.one("Gather", [x, lens.POSITION], name, axis=1)


def _scale(g: Graph, form: Description, x: str, name: str) -> str:
    """The norm's divisor of x (B, 1, d): √(mean(x²) + ε), or LayerNorm's √(var + ε)."""
    if form.norm == "layer":
        x = _centred(g, x, f"{name}.centred")
    var = g.one("ReduceMean", [g.one("Mul", [x, x], f"{name}.sq"), "axis_last"],
                f"{name}.var", keepdims=1)  # (B, 1, 1)
    eps = g.const(f"{name}.eps", np.array(form.eps, np.float32))
    return g.one("Sqrt", [g.one("Add", [var, eps], f"{name}.var_eps")], name)


def _centred(g: Graph, x: str, name: str) -> str:
    mean = g.one("ReduceMean", [x, "axis_last"], f"{name}.mean", keepdims=1)
    return g.one("Sub", [x, mean], name)


def _linearised(g: Graph, form: Description, rows: str, scale: str, weight: str,
                name: str) -> str:
    """γ ⊙ rows / scale (rows centred first under LayerNorm): the norm's map, frozen at
    the whole input's scale, applied to each component."""
    if form.norm == "layer":
        rows = _centred(g, rows, f"{name}.centred")
    return g.one("Mul", [g.one("Div", [rows, scale], f"{name}.unit"), weight], name)


def _row(g: Graph, like: str, bias: str | None, name: str) -> str:
    """A bias (d,) as a (B, 1, d) row shaped as ``like``; zeros without one."""
    zero = g.one("Mul", [like, g.const("zero_f", np.array(0.0, np.float32))], f"{name}.zero")
    return zero if bias is None else g.one("Add", [zero, bias], name)


def _head_mask(g: Graph, form: Description) -> str:
    """(nh, W): row h is 1 over head h's slice of o_proj's input."""
    nh, hs = form.n_heads, form.head_dim
    return g.const("attribution.head_mask", np.kron(np.eye(nh, dtype=np.float32),
                                                    np.ones((1, hs), np.float32)))


def _attribution(g: Graph, form: Description, gpt: Any, table: np.ndarray, embedded: str,
                 taps: list[LayerTaps], last_normed: str) -> list[str]:
    if form.post_norms and form.norm == "layer":
        raise NotImplementedError("post norms are linearised as RMSNorm only (Gemma 3)")
    final = _at(g, taps[-1].residual, "attribution.final")  # (B, 1, d)
    scale = _scale(g, form, final, "attribution.scale")  # (B, 1, 1)
    # The model's own logits at the position, and its next token: the default target.
    normed = _at(g, last_normed, "attribution.final_normed")  # (B, 1, d)
    flat = g.one("Reshape", [normed, "shape_flat"], "attribution.final_flat")  # (B, d)
    logits = _head(g, form, table, flat, "attribution.logits")  # (B, V)
    own = g.one("ArgMax", [g.one("Slice", [logits, g.ints("start0", [0]), g.ints("end1", [1])],
                                 "attribution.first_row")], "attribution.own", axis=-1,
                keepdims=0)  # (1,)
    given = g.one("GreaterOrEqual", [lens.TARGET, g.ints("zero_1", [0])], "attribution.given")
    target = g.op("Where", [given, lens.TARGET, own], "attribution.choose",
                  outputs=[lens.ATTRIBUTION_TARGET])[0]
    g.op("Gather", [logits, target], "attribution.logit_of", outputs=[lens.ATTRIBUTION_LOGIT],
         axis=1)  # (B, 1)
    rows = [_at(g, embedded, "attribution.embedding")]  # (B, 1, d) each
    mask = _head_mask(g, form)
    for i, (tap, block) in enumerate(zip(taps, gpt.blocks, strict=True)):
        p = f"attribution.l{i}"
        merged = g.one("Mul", [g.one("Unsqueeze", [_at(g, tap.merged, f"{p}.z"),
                                                g.ints("axis2", [2])],
                                     f"{p}.z4"), mask], f"{p}.z_heads")  # (B, 1, nh, W)
        heads = g.one("Squeeze", [g.one("MatMul", [merged, f"l{i}.o.w"], f"{p}.heads_4d"),
                                  g.ints("axis1", [1])], f"{p}.heads")  # (B, nh, d)
        attention = _at(g, tap.attention, f"{p}.attention")  # (B, 1, d)
        o_bias = _row(g, attention, f"l{i}.o.b" if form.out_bias else None, f"{p}.o_bias")
        if form.post_norms:  # post_attn(Σ heads): Σ γ ⊙ head / rms(Σ heads), as ln_f's
            attn_scale = _scale(g, form, attention, f"{p}.post_scale")
            heads = _linearised(g, form, heads, attn_scale, f"l{i}.post_attn.w", f"{p}.heads_n")
            o_bias = _linearised(g, form, o_bias, attn_scale, f"l{i}.post_attn.w",
                                 f"{p}.o_bias_n")
        mlp = _at(g, tap.mlp, f"{p}.mlp_out")
        has_down_bias = block.ffn.down.bias is not None and not form.post_norms
        down_bias = _row(g, mlp, f"l{i}.down.b" if has_down_bias else None, f"{p}.down_bias")
        if has_down_bias:
            mlp = g.one("Sub", [mlp, down_bias], f"{p}.mlp")
        rows += [heads, o_bias, mlp, down_bias, _row(g, mlp, tap.steer, f"{p}.steer")]
    components = g.one("Concat", rows, "attribution.components", axis=1)  # (B, n − 1, d)
    ln_w = "ln_f.w"
    terms = [_linearised(g, form, components, scale, ln_w, "attribution.linear")]
    terms.append(_row(g, final, "ln_f.b" if form.norm == "layer" else None,
                      "attribution.norm_bias"))
    all_terms = g.one("Concat", terms, "attribution.all", axis=1)  # (B, n, d)
    flat = g.one("Reshape", [all_terms, "shape_flat"], "attribution.flat")  # (B·n, d)
    per_term = _head(g, form, table, flat, "attribution.term_logits")
    picked = g.one("Gather", [per_term, target], "attribution.picked", axis=1)  # (B·n, 1)
    by_batch = g.ints("shape_b_any", [-1, len(lens.terms(len(taps), form.n_heads))])
    g.op("Reshape", [picked, by_batch], "attribution.shaped", outputs=[lens.ATTRIBUTION_TERMS])
    return [lens.ATTRIBUTION_TARGET, lens.ATTRIBUTION_LOGIT, lens.ATTRIBUTION_TERMS]


def input_shapes() -> dict[str, list[str | int]]:
    """The inputs' shapes, for the graph's declaration."""
    return {name: [1] for name in lens.INPUT_DEFAULTS}


def int64_outputs(n_layers: int) -> list[str]:
    """The outputs that are ids or counts; every other one is float32."""
    return [*(lens.lens_output_name(i, k) for i in range(n_layers)
              for k in ("top_ids", "target_rank")), lens.ATTRIBUTION_TARGET]


def output_shapes(n_layers: int) -> dict[str, list[str | int]]:
    seq: list[str | int] = [io.BATCH, io.SEQUENCE]
    shapes: dict[str, list[str | int]] = {lens.residual_norm_name(i): seq for i in range(n_layers)}
    for i in range(n_layers):
        for kind in lens.LENS_KINDS:
            shapes[lens.lens_output_name(i, kind)] = (
                [*seq, "top_k"] if kind.startswith("top") else seq)
    shapes[lens.ATTRIBUTION_TARGET] = [1]
    shapes[lens.ATTRIBUTION_LOGIT] = [io.BATCH, 1]
    shapes[lens.ATTRIBUTION_TERMS] = [io.BATCH, "terms"]
    return shapes
