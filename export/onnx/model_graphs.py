"""model.onnx and attention.onnx, written node by node from model.gpt.GPT's weights.

``model.onnx`` is one merged decoder graph: the same graph runs prefill (past tensors of
length 0) and cached decode, because the past is simply concatenated in front of this
call's keys and values. ``attention.onnx`` is the introspection graph: no cache, every
layer's Q, K, V, raw and scaled scores and attention weights as outputs, and the logit
lens, residual norms and head attribution (export/onnx/lens_graph.py), all under an
optional control vector (the ``steer`` input, added after each block k >= 1 as the engine
graphs add each row's).

Both compute what GPT.forward computes, op for op (the export verifies it against
PyTorch): the boolean mask of ``attention_allowed``, rotary angles from ``position_ids``
as model/rotary.py forms them, grouped-query attention by folding each group's query
heads into the query axis (the cache is multiplied as it is, never repeated). Only
standard ONNX operators are used, so any runtime can read the contract graph; ONNX
Runtime fuses them (LayerNorm, Gelu, MatMul(Q, Transpose(K)) → FusedMatMul) when a
session loads. The norm, MLP and LM head nodes are export/onnx/layers.py's, chosen by the
model's description (model/architectures/description.py); attention, masks and positions
are written here for every family. Weight names and layouts are shared with engine.onnx
(export/onnx/onnx_build.py stores each tensor once for all three).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from export.onnx import layers, lens_graph
from export.onnx.onnx_build import Graph, WeightsWriter, f32, make_model
from model.architectures import architecture
from model.config import GPTConfig
from model.gpt import GPT
from service.contract import io_spec as io

DEFAULT_OPSET = 18
# Every operator used here has the same meaning from opset 18 to 21, so the requested
# version is simply declared (checked to load and run on onnxruntime).
SUPPORTED_OPSETS = (18, 19, 20, 21)
_DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}


def grouped_kv(cfg: GPTConfig) -> bool:
    """Whether the cache has fewer heads than the queries (grouped-query attention)."""
    return cfg.kv_heads != cfg.n_heads


class DecoderBuilder:
    """The nodes of one decoder graph; ``cached`` adds past/present, ``introspect`` adds
    every layer's attention intermediates as outputs."""

    def __init__(self, gpt: GPT, cached: bool, introspect: bool,
                 kv_dtype: io.KvDtype = "float32", matmul_head: bool = False,
                 weights: WeightsWriter | None = None) -> None:
        self.gpt = gpt
        self.form = architecture(gpt.config.arch).describe(gpt.config)
        self.cached, self.introspect, self.kv_dtype = cached, introspect, kv_dtype
        self.matmul_head = matmul_head
        self.g = Graph(weights)
        self.outputs: list[str] = []

    # -- leaves --------------------------------------------------------------------------
    def _norm(self, x: str, module: Any, name: str) -> str:
        return layers.norm(self.g, self.form, x, module, name)

    def _heads(self, x: str, heads: int, name: str) -> str:
        """(B, T, heads·hs) → (B, heads, T, hs)."""
        g = self.g
        shaped = g.one("Reshape", [x, g.ints(f"shape_heads{heads}",
                                             [0, 0, heads, self.form.head_dim])], f"{name}.bthd")
        return g.one("Transpose", [shaped], name, perm=[0, 2, 1, 3])

    def _rotate(self, x: str, cos: str, sin: str, name: str) -> str:
        """x·cos + rotate_half(x)·sin (model/rotary.py's layout), over the first rd
        dimensions of each head (all of them but under partial rotary)."""
        g, rd, hs = self.g, self.form.rotary_dims, self.form.head_dim
        kept = None
        if rd < hs:  # (…, rd) turn, (…, hs − rd) pass
            x, kept = g.op("Split", [x, g.ints("split_rotary", [rd, hs - rd])],
                           f"{name}.parts", n_out=2, axis=-1)
        half = rd // 2
        x1, x2 = g.op("Split", [x, g.ints("split_half", [half, half])], f"{name}.halves",
                      n_out=2, axis=-1)
        rotated = g.one("Concat", [g.one("Neg", [x2], f"{name}.neg"), x1], f"{name}.rot",
                        axis=-1)
        out = g.one("Add", [g.one("Mul", [x, cos], f"{name}.xcos"),
                            g.one("Mul", [rotated, sin], f"{name}.rsin")],
                    name if kept is None else f"{name}.turned")
        return out if kept is None else g.one("Concat", [out, kept], name, axis=-1)

    # -- shared inputs -------------------------------------------------------------------
    def _mask_biases(self) -> tuple[str, str]:
        """0 where a query may attend, -inf elsewhere, (B, 1, T, S), as attention_allowed:
        (every layer's, the window layers'); the same one twice without layers apart."""
        g = self.g
        t = g.one("Gather", [g.one("Shape", [io.INPUT_IDS], "ids_shape"),
                             g.const("one_i", np.array(1, np.int64))], "T", axis=0)
        s = g.one("Gather", [g.one("Shape", [io.ATTENTION_MASK], "mask_shape"), "one_i"], "S",
                  axis=0)
        zero, step = g.const("zero_i", np.array(0, np.int64)), "one_i"
        query = g.one("Unsqueeze", [g.one("Range", [g.one("Sub", [s, t], "P"), s, step],
                                          "query_pos"), g.ints("axis1", [1])], "query_col")
        key = g.one("Unsqueeze", [g.one("Range", [zero, s, step], "key_pos"),
                                  g.ints("axis0", [0])], "key_row")  # (1, S)
        causal = g.one("LessOrEqual", [key, query], "causal")  # (T, S)
        diagonal = g.one("Equal", [key, query], "diagonal")  # (T, S)
        real = g.one("Unsqueeze", [g.one("Cast", [io.ATTENTION_MASK], "mask_bool",
                                         to=TensorProto.BOOL), g.ints("axes12", [1, 2])],
                     "not_padding")  # (B, 1, 1, S)

        def bias(seen: str, tag: str) -> str:
            allowed = g.one("Or", [g.one("And", [seen, real], f"causal_real{tag}"), diagonal],
                            f"allowed{tag}")  # (B, 1, T, S)
            return g.one("Where", [allowed, g.const("zero_f", np.array(0.0, np.float32)),
                                   g.const("neg_inf", np.array(-np.inf, np.float32))],
                         f"mask_bias{tag}")

        form = self.form
        if form.sliding_window is None:
            every = bias(causal, "")
            return every, every
        # only the last W positions (Mistral's layers, Gemma 3's window layers)
        near = g.one("Less", [g.one("Sub", [query, key], "distance"),
                              g.const("window", np.array(form.sliding_window, np.int64))],
                     "in_window")
        local = bias(g.one("And", [causal, near], "causal_window"), "_window")  # (T, S)
        return (bias(causal, "") if form.global_layers else local), local

    def _rotary(self, rotary: Any, pos: str, p: str = "rope") -> tuple[str, str]:
        """cos, sin (B, 1, T, hs) from the positions ``pos`` (B, T, 1), as ``rotary``
        (model/rotary.py's Rotary: gpt.rotary, or Gemma 3's window layers'
        gpt.rotary_local) forms them."""
        g = self.g
        inv_freq = f32(rotary.inv_freq)  # (hs/2,)
        freqs = g.one("Mul", [pos, g.const(f"{p}.inv_freq", inv_freq)],
                      f"{p}.freqs")  # (B, T, hs/2)
        emb = g.one("Unsqueeze", [g.one("Concat", [freqs, freqs], f"{p}.emb", axis=-1),
                                  "axis1"], f"{p}.emb4")  # (B, 1, T, hs)
        cos, sin = g.one("Cos", [emb], f"{p}.cos"), g.one("Sin", [emb], f"{p}.sin")
        if rotary.scale != 1.0:  # LongRoPE's attention factor (model/rotary.py)
            scale = g.const(f"{p}.scale", np.array(rotary.scale, np.float32))
            cos = g.one("Mul", [cos, scale], f"{p}.cos_scaled")
            sin = g.one("Mul", [sin, scale], f"{p}.sin_scaled")
        return cos, sin

    # -- the block -----------------------------------------------------------------------
    def _attention(self, i: int, h: str, bias: str, rotary: tuple[str, str] | None) -> str:
        block: Any = self.gpt.blocks[i]
        g, form, attn = self.g, self.form, block.attn
        p, nh, nkv, hs = f"l{i}", form.n_heads, form.kv_heads, form.head_dim
        kv, width = nkv * hs, form.attention_width
        qkv = layers.linear(g, h, layers.qkv_weight(attn), layers.qkv_bias(attn),
                            f"{p}.qkv")  # (B, T, w + 2kv)
        q, k, v = g.op("Split", [qkv, g.ints(f"split_qkv{kv}", [width, kv, kv])],
                       f"{p}.split", n_out=3, axis=-1)
        q, k, v = (self._heads(q, nh, f"{p}.q"), self._heads(k, nkv, f"{p}.k_new"),
                   self._heads(v, nkv, f"{p}.v_new"))  # (B, heads, T, hs)
        if form.qk_norm:  # Qwen3: each head's query and key, over hs
            q = self._norm(q, attn.q_norm, f"{p}.q_norm")
            k = self._norm(k, attn.k_norm, f"{p}.k_norm")
        if rotary is not None:
            q, k = self._rotate(q, *rotary, f"{p}.q_rot"), self._rotate(k, *rotary, f"{p}.k_rot")
        if self.cached:
            pasts = [io.past_key_name(i), io.past_value_name(i)]
            if self.kv_dtype == "float16":
                pasts = [g.one("Cast", [n], f"{n}.f32", to=TensorProto.FLOAT) for n in pasts]
            k = g.one("Concat", [pasts[0], k], f"{p}.k", axis=2)  # (B, nkv, S, hs)
            v = g.one("Concat", [pasts[1], v], f"{p}.v", axis=2)  # (B, nkv, S, hs)
            for value, out in ((k, io.present_key_name(i)), (v, io.present_value_name(i))):
                if self.kv_dtype == "float16":
                    g.op("Cast", [value], f"{out}.cast", outputs=[out], to=TensorProto.FLOAT16)
                else:
                    g.op("Identity", [value], f"{out}.id", outputs=[out])
        # The rep query heads of a group share one key head: fold them into the query axis.
        grouped = g.ints("shape_grouped", [0, nkv, -1, hs])
        by_head = g.ints("shape_by_head", [0, nh, -1, 0])
        qg = g.one("Reshape", [q, grouped], f"{p}.q_grouped")  # (B, nkv, rep·T, hs)
        kt = g.one("Transpose", [k], f"{p}.kt", perm=[0, 1, 3, 2])  # (B, nkv, hs, S)
        scores = g.one("Reshape", [g.one("MatMul", [qg, kt], f"{p}.qk"), by_head],
                       f"{p}.scores")  # (B, nh, T, S)
        if form.attn_scale is None:  # QKᵀ/√hs, as PyTorch's attention divides
            raw = g.one("Div", [scores, g.const(f"sqrt_hs{hs}", np.array(
                math.sqrt(hs), np.float32))], f"{p}.scaled_raw")
        else:  # Gemma 3's query_pre_attn_scalar^-1/2, multiplied as transformers does
            raw = g.one("Mul", [scores, g.const("attn_scale", np.array(
                form.attn_scale, np.float32))], f"{p}.scaled_raw")
        scaled = g.one("Add", [raw, bias], f"{p}.scaled")
        weights = g.one("Softmax", [scaled], f"{p}.weights", axis=-1)  # (B, nh, T, S)
        ctx = g.one("MatMul", [g.one("Reshape", [weights, g.ints("shape_grouped_s",
                                                                   [0, nkv, -1, 0])],
                                     f"{p}.w_grouped"), v], f"{p}.ctx_grouped")
        ctx = g.one("Transpose", [g.one("Reshape", [ctx, g.ints("shape_by_head_hs",
                                                                  [0, nh, -1, hs])],
                                        f"{p}.ctx_heads")], f"{p}.ctx_bthd", perm=[0, 2, 1, 3])
        merged = g.one("Reshape", [ctx, g.ints("shape_merge", [0, 0, width])], f"{p}.ctx")
        if self.introspect:
            self._record(i, q, k, v, scores, scaled, weights)
        b_o = f32(attn.w_o.bias) if self.form.out_bias else None
        return layers.linear(g, merged, f32(attn.w_o.weight).T, b_o, f"{p}.o")  # (B, T, d)

    def _record(self, i: int, *values: str) -> None:
        """Name layer i's intermediates as outputs; k and v per query head (GQA: repeated)."""
        g, form = self.g, self.form
        rep = form.n_heads // form.kv_heads
        for kind, value in zip(io.ATTENTION_KINDS, values, strict=True):
            if kind in ("k", "v") and rep > 1:
                value = g.one("Reshape", [g.one("Tile", [
                    g.one("Unsqueeze", [value, g.ints("axis2", [2])], f"l{i}.{kind}_5d"),
                    g.ints("tile_rep", [1, 1, rep, 1, 1])], f"l{i}.{kind}_tiled"),
                    g.ints("shape_by_head_hs", [0, form.n_heads, -1, form.head_dim])],
                    f"l{i}.{kind}_per_head")
            name = io.attention_output_name(i, kind)
            g.op("Identity", [value], f"{name}.id", outputs=[name])
            self.outputs.append(name)

    def _logits(self, x: str) -> None:
        g, form = self.g, self.form
        h = self._norm(x, self.gpt.ln_f, "ln_f")  # (B, T, d)
        flat = g.one("Reshape", [h, g.ints("shape_flat", [-1, form.d_model])], "ln_f_flat")
        logits = layers.lm_head(g, self.form, self.gpt, flat, self.matmul_head)  # (N, V)
        shape = g.one("Concat", ["ids_shape", g.ints("minus1", [-1])], "shape_btv", axis=0)
        g.op("Reshape", [logits, shape], "logits_btv", outputs=[io.LOGITS])  # (B, T, V)

    def _steer_row(self, i: int) -> str | None:
        """attention.onnx: the control vector's row i (d,), added after block i as llama.cpp
        adds it (model/steering.py: never after block 0); None in model.onnx."""
        if not self.introspect or i == 0:
            return None
        g = self.g
        return g.one("Gather", [io.STEER, g.const(f"steer_layer{i}", np.array(i, np.int64))],
                     f"l{i}.steer", axis=0)  # (d,)

    def build(self) -> None:
        g, gpt, form = self.g, self.gpt, self.form
        every, local = self._mask_biases()
        x = g.one("Gather", [g.const("tok_emb", f32(gpt.tok_emb.weight)), io.INPUT_IDS],
                  "tok_gather")  # (B, T, d)
        rotary = rotary_local = None
        if form.rotary:
            pos = g.one("Unsqueeze", [g.one("Cast", [io.POSITION_IDS], "pos_f",
                                            to=TensorProto.FLOAT), g.ints("axis_last", [-1])],
                        "pos_col")  # (B, T, 1)
            rotary = self._rotary(gpt.rotary, pos)
            if gpt.rotary_local is not None:
                rotary_local = self._rotary(gpt.rotary_local, pos, "rope_local")
            if form.embed_scale is not None:  # Gemma: √d in float32
                x = g.one("Mul", [x, g.const("embed_scale", np.array(form.embed_scale,
                                                                     np.float32))], "embed")
        else:
            table: Any = gpt.pos_emb.weight if gpt.pos_emb is not None else gpt.pos_table
            x = g.one("Add", [x, g.one("Gather", [g.const("pos_emb", f32(table)),
                                                 io.POSITION_IDS], "pos_gather")], "embed")
        embedded, taps = x, []
        for i, (block, layer) in enumerate(zip(gpt.blocks, form.layers, strict=True)):
            turn = {"global": rotary, "local": rotary_local, None: None}[layer.rotary]
            a = out = self._attention(i, self._norm(x, block.ln_1, f"l{i}.ln1"),
                                      local if layer.windowed else every, turn)
            if form.post_norms:  # Gemma 3's sandwich
                a = self._norm(a, block.post_attn, f"l{i}.post_attn")
            x = g.one("Add", [x, a], f"l{i}.res1")
            f = layers.mlp(g, form, self._norm(x, block.ln_2, f"l{i}.ln2"), block.ffn,
                           f"l{i}")
            if form.post_norms:
                f = self._norm(f, block.post_ffn, f"l{i}.post_ffn")
            x = g.one("Add", [x, f], f"l{i}.res2")  # (B, T, d)
            steer = self._steer_row(i)
            if steer is not None:
                x = g.one("Add", [x, steer], f"l{i}.steered")  # (B, T, d)
            taps.append(lens_graph.LayerTaps(f"l{i}.ctx", out, f, x, steer))
        if self.introspect:  # the logit lens and attribution (export/onnx/lens_graph.py)
            self.outputs += lens_graph.write(g, form, gpt, embedded, taps)
        else:
            self._logits(x)


def _value_infos(shapes: dict[str, list[Any]], static: dict[str, int],
                 dtypes: dict[str, Any]) -> list[onnx.ValueInfoProto]:
    return [helper.make_tensor_value_info(name, dtypes.get(name, TensorProto.FLOAT),
                                          [static.get(dim, dim) for dim in dims])
            for name, dims in shapes.items()]


def build_decoder(gpt: GPT, opset: int = DEFAULT_OPSET, kv_dtype: io.KvDtype = "float32",
                  matmul_head: bool = False,
                  weights: WeightsWriter | None = None) -> onnx.ModelProto:
    """model.onnx: the merged prefill/decode graph with KV cache (the I/O contract).
    ``weights``: store the large initializers there as they are made (:class:`Graph`)."""
    cfg = gpt.config
    builder = DecoderBuilder(gpt.eval(), cached=True, introspect=False, kv_dtype=kv_dtype,
                             matmul_head=matmul_head, weights=weights)
    builder.build()
    shapes = io.model_io_shapes(cfg.n_layers, grouped_kv(cfg))
    static = {"num_heads": cfg.n_heads, io.KV_HEADS: cfg.kv_heads, "head_dim": cfg.head_dim,
              "vocab_size": cfg.vocab_size}
    kv = _DTYPES[kv_dtype]
    dtypes = {io.INPUT_IDS: TensorProto.INT64, io.ATTENTION_MASK: TensorProto.INT64,
              io.POSITION_IDS: TensorProto.INT64,
              **{n: kv for n in io.past_names(cfg.n_layers) + io.present_names(cfg.n_layers)}}
    return make_model(builder.g, "attnserve_decoder",
                      _value_infos(shapes["inputs"], static, dtypes),
                      _value_infos(shapes["outputs"], static, dtypes), opset,
                      f"attnserve decoder with KV cache; kv_dtype={kv_dtype}; logits float32; "
                      "I/O per service/contract/io_spec.py")


def attention_io_shapes(n_layers: int) -> dict[str, dict[str, list[Any]]]:
    """Symbolic shapes of attention.onnx (no cache: keys span the query sequence)."""
    seq = [io.BATCH, io.SEQUENCE]
    per_head = [io.BATCH, "num_heads", io.SEQUENCE, "head_dim"]
    square = [io.BATCH, "num_heads", io.SEQUENCE, io.SEQUENCE]
    outputs = {
        io.attention_output_name(i, k): per_head if k in ("q", "k", "v") else square
        for i in range(n_layers) for k in io.ATTENTION_KINDS
    }
    return {"inputs": {name: seq for name in io.attention_input_names()},
            "outputs": {**outputs, **lens_graph.output_shapes(n_layers)}}


def build_attention(gpt: GPT, opset: int = DEFAULT_OPSET,
                    weights: WeightsWriter | None = None) -> onnx.ModelProto:
    """attention.onnx: every layer's intermediates for a whole (left-padded) prompt.
    ``weights``: as :func:`build_decoder`'s."""
    cfg = gpt.config
    builder = DecoderBuilder(gpt.eval(), cached=False, introspect=True, weights=weights)
    lens_graph.declare_inputs(builder.g)
    builder.g.const(io.STEER, np.zeros((cfg.n_layers, cfg.d_model), np.float32))  # steers nothing
    builder.build()
    shapes = attention_io_shapes(cfg.n_layers)
    static = {"num_heads": cfg.n_heads, "head_dim": cfg.head_dim}
    ints = {name: TensorProto.INT64 for name in io.attention_input_names()}
    ints |= {name: TensorProto.INT64 for name in lens_graph.input_shapes()}
    int_outputs = {name: TensorProto.INT64 for name in lens_graph.int64_outputs(cfg.n_layers)}
    inputs = shapes["inputs"] | lens_graph.input_shapes() | {
        io.STEER: [cfg.n_layers, cfg.d_model]}
    return make_model(builder.g, "attnserve_attention",
                      _value_infos(inputs, static, ints),
                      _value_infos(shapes["outputs"], static, int_outputs), opset,
                      "attnserve attention introspection: q, k, v, scores, scaled_scores, "
                      "weights; logit lens, residual norms, attribution; steer: a control "
                      "vector")


def build_graphs(gpt: GPT, weights: WeightsWriter, opset: int, dtype: io.KvDtype,
                 matmul: bool, engine_graph: bool, mixed_steps: bool) -> None:
    """model.onnx, attention.onnx and the engine graphs asked for into ``weights``'
    directory, each graph's weights written as it is built (no graph holds them in
    memory). ``matmul``: every weight product a MatMul, for quantisation to rewrite."""
    from export.onnx.engine_graph import build_engine_graph
    from service.contract.engine_spec import ENGINE_FILE, ENGINE_MIXED_FILE

    weights.add(io.MODEL_FILE, build_decoder(gpt, opset, dtype, weights=weights,
                                             matmul_head=matmul))
    weights.add(io.ATTENTION_FILE, build_attention(gpt, opset, weights=weights))
    if engine_graph:
        weights.add(ENGINE_FILE, build_engine_graph(gpt, matmul_only=matmul, weights=weights))
    if engine_graph and mixed_steps:
        weights.add(ENGINE_MIXED_FILE, build_engine_graph(gpt, matmul_only=matmul, mixed=True,
                                                          weights=weights))
