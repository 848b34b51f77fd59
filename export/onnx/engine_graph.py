"""Build engine.onnx: the serving engine's own decoder graph, written node by node.

model.onnx follows the Hugging Face past/present convention, so every decode step
concatenates the whole cache into a new present tensor, and its attention is a dozen
small ops. engine.onnx keeps the same weights and arithmetic but runs attention in ONNX
Runtime's fused ``com.microsoft.GroupQueryAttention`` over a preallocated cache of
``max_seq_len`` positions that is both the past input and the present output: bound to the
same OrtValue, the kernel writes each new key/value in place and nothing is copied.

Each row's cache starts at position 0 (no left padding); ``seqlens_k`` (total length − 1
per row) tells the kernel where a row ends. Learned (or sinusoidal) positions stay table
lookups by ``position_ids``, outside the attention op; rotary models hand the kernel
their cos/sin tables and their key/value head count instead. The skeleton below is the
same for every family; the embeddings, norms, Q/K/V projection, MLP and LM head nodes are
export/onnx/layers.py's, chosen by the model's description
(model/architectures/description.py). Only the service uses this graph; model.onnx
remains the contract graph for every other tool.

Only the positions named by ``logits_index`` reach the LM head: a prefill wants each row's
last token (or every token, for prompt logprobs), a decode step its one, so the (B·T, V)
head product — a fifth of a prefill's work on a 49k vocabulary, and a (B, T, V) float32
buffer the allocator would keep — is computed for B·K rows only. The gather takes the
final norm's output (the norm is per position and fused with the last residual add, so
norming all T positions costs N·d, nothing beside the head's N·d·V).

The I/O names and shapes are in service/contract/engine_spec.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from export.onnx import layers
from export.onnx.layers import CONTRIB
from export.onnx.onnx_build import Graph, WeightsWriter, f32, make_model
from model.architectures import architecture
from model.architectures.description import Description
from model.gpt import GPT
from service.contract import engine_spec as es
from service.contract import io_spec as io
from service.contract.engine_spec import (
    LOGITS_INDEX,
    LOGITS_POSITIONS,
    MAX_SEQUENCE,
    SEQLENS_K,
    STEER,
    STEER_ROWS,
    TOTAL_SEQUENCE_LENGTH,
)

ENGINE_OPSET = 18


@dataclass(frozen=True)
class _Rows:
    """One GroupQueryAttention call's rows: the names of its inputs and outputs.

    The plain graph has one group; the mixed graph a second (``chunk.*``), so the decode
    rows and a prompt chunk share every weight product and differ only in attention.
    """

    ids: str
    positions: str
    seqlens: str
    total: str
    index: str
    logits: str
    past: list[str]
    present: list[str]
    tag: str  # node-name suffix: "" for the first group


def _groups(n_layers: int, mixed: bool) -> list[_Rows]:
    first = _Rows(io.INPUT_IDS, io.POSITION_IDS, SEQLENS_K, TOTAL_SEQUENCE_LENGTH,
                  LOGITS_INDEX, io.LOGITS, io.past_names(n_layers),
                  io.present_names(n_layers), "")
    if not mixed:
        return [first]
    c = es.chunk_name
    return [first, _Rows(c(io.INPUT_IDS), c(io.POSITION_IDS), c(SEQLENS_K),
                         c(TOTAL_SEQUENCE_LENGTH), c(LOGITS_INDEX), c(io.LOGITS),
                         [c(n) for n in io.past_names(n_layers)],
                         [c(n) for n in io.present_names(n_layers)], ".chunk")]


def build_engine_graph(gpt: GPT, matmul_only: bool = False, logits_index: bool = True,
                       mixed: bool = False, weights: WeightsWriter | None = None,
                       steering: bool = True) -> onnx.ModelProto:
    """The decoder as fused ONNX Runtime nodes, weights from ``gpt``, for every family.

    ``logits_index=False`` writes the graph as exported before that input existed (logits
    of every fed position), which the service still serves; only tests build it now.

    ``matmul_only`` writes every weight product as a MatMul (a bias as a separate Add)
    instead of Gemm/FusedGemm, because weight quantisation (MatMulNBits) rewrites only
    MatMul nodes; the Adds are cheap elementwise ops over (N, ·).

    ``mixed`` adds a second group of rows (``chunk.*`` inputs and outputs, its own KV
    buffers): both groups' tokens go through every projection and MLP as one (N, d)
    matrix, so the weights are read once, and only attention runs per group (ONNX
    Runtime's GroupQueryAttention takes a multi-token step over a cache for one row at a
    time, so decode rows and a prompt chunk cannot share one call).

    Hidden states stay flat, (N = B·T, d), so projections with a bias become one Gemm
    (FusedGemm with the ReLU folded in; BiasGelu or FastGelu take GELU's bias), and every
    residual add joins its LayerNorm in one SkipLayerNormalization, the output
    projections' biases included. Only attention sees
    (B, T, ·), through two reshapes that alias rather than copy.

    ``weights``: store the large initializers there as they are made (export/onnx/onnx_build.py's
    :class:`Graph`), so the graph never holds them.

    ``steering``: the ``steer`` input (engine_spec.py), each row's control vector added
    after every block but the first (:func:`_token_rows`); its default of zeros steers
    nothing, and the two gathers and one add a layer cost a decode step little (docs/steering.md).
    """
    form = architecture(gpt.config.arch).describe(gpt.config)
    groups = _groups(len(form.layers), mixed)
    if mixed and not logits_index:
        raise ValueError("the mixed engine graph always takes logits_index")
    nh, hs, d = form.n_heads, form.head_dim, form.d_model
    g = Graph(weights)
    # (cos, sin) for GroupQueryAttention (and Gemma 3's window layers'), or None
    rotary, rotary_local = layers.position_tables(g, form, gpt)
    minus1 = g.const("minus1", np.array([-1], np.int64))
    flat = g.const("shape_flat", np.array([-1, d], np.int64))  # [N, d]
    shapes_btc = []  # per group: [B, T, -1]
    for r in groups:
        ids_shape = g.op("Shape", [r.ids], f"ids_shape{r.tag}")[0]  # [B, T]
        shapes_btc.append(g.op("Concat", [ids_shape, minus1], f"shape_btc{r.tag}",
                               axis=0)[0])
    width = form.attention_width + 2 * form.kv_heads * hs  # q | k | v
    # the attention output, (N, nh·hs): d wide unless the heads are wider (Qwen3)
    flat_attn = flat if form.attention_width == d else g.const(
        "shape_flat_attn", np.array([-1, form.attention_width], np.int64))
    if mixed:  # both groups' tokens as one row, (1, N): the embedding sees one sequence
        row = g.const("shape_row", np.array([1, -1], np.int64))
        ids, pos = (g.op("Concat", [g.op("Reshape", [getattr(r, name), row],
                                         f"{name}_flat{r.tag}")[0] for r in groups],
                         f"{name}_row", axis=1)[0] for name in ("ids", "positions"))
        sizes = _sizes(g, [r.ids for r in groups], "tokens")  # [N1, N2]
        chunk = _ChunkShapes(g, groups[1], width, d, form.vocab_size)
        shapes_btc[1] = chunk.btc
    else:
        ids, pos = io.INPUT_IDS, io.POSITION_IDS
    # each token's row of ``steer`` (N,): the gathers' index at every layer
    token_rows = _token_rows(g, groups) if steering else None
    embed = layers.embed(g, form, gpt, ids, pos)  # (B, T, d)
    x = g.op("Reshape", [embed, flat], "embed_flat")[0]  # (N, d)
    blocks: list[Any] = list(gpt.blocks)
    h = layers.fused_norm(g, form, x, blocks[0].ln_1, "l0.ln1")  # (N, d)
    # a sliding window of W positions, the query's own included, is the kernel's
    # local_window_size W (checked against PyTorch by the export's verification)
    for i, (block, layer) in enumerate(zip(blocks, form.layers, strict=True)):
        a, p = block.attn, f"l{i}"
        window: dict[str, int] = ({"local_window_size": int(form.sliding_window)}
                                  if form.sliding_window is not None and layer.windowed else {})
        rope: dict[str, int] = {"do_rotary": 0}
        tables: tuple[str, ...] = ()
        if rotary is not None and layer.rotary is not None:  # the kernel rotates Q and K
            rope = {"do_rotary": 1, "rotary_interleaved": 0}  # by each row's position
            tables = rotary_local if rotary_local is not None and layer.rotary == "local" \
                else rotary
        qkv = layers.fused_qkv(g, form, h, a, p, matmul_only)  # (N, nh·hs + 2·kv): q | k | v
        if form.qk_norm:  # Qwen3: each head's query and key RMS-normalised first
            qkv = _normed_qk(g, form, qkv, a, p)
        parts = (g.op("Split", [qkv, sizes], f"{p}.qkv_split", n_out=len(groups), axis=0)
                 if mixed else [qkv])  # per group (N_g, d + 2·kv)
        attns = []
        for part, r, shape_btc in zip(parts, groups, shapes_btc, strict=True):
            part = g.op("Reshape", [part, shape_btc], f"{p}.qkv_btc{r.tag}",
                        **_exact(r))[0]  # (B, T, ·)
            if r.tag:  # the chunk group: T' = max(T, 1) rows, a zero row when T = 0
                part = chunk.pad(part, f"{p}.qkv_padded{r.tag}")  # (B, T', ·)
            attn = g.op(
                "GroupQueryAttention",
                [part, "", "", r.past[2 * i], r.past[2 * i + 1], r.seqlens, r.total,
                 *tables],
                f"{p}.gqa{r.tag}", outputs=[f"{p}.attn{r.tag}", r.present[2 * i],
                                            r.present[2 * i + 1]],
                domain=CONTRIB, num_heads=nh, kv_num_heads=form.kv_heads,
                scale=float(1.0 / np.sqrt(hs)) if form.attn_scale is None else form.attn_scale,
                **rope, **window)[0]  # (B, T, d)
            if r.tag:
                attn = chunk.unpad(attn, f"{p}.attn_unpadded{r.tag}")  # (B, T, d)
            attns.append(g.op("Reshape", [attn, flat_attn],
                              f"{p}.attn_flat{r.tag}")[0])  # (N_g, nh·hs)
        attn = g.op("Concat", attns, f"{p}.attn_all", axis=0)[0] if mixed else attns[0]
        o = g.op("MatMul", [attn, g.const(f"{p}.w_o", f32(a.w_o.weight).T)], f"{p}.o")[0]
        o_bias = [g.const(f"{p}.b_o", f32(a.w_o.bias))] if form.out_bias else []
        if form.post_norms:  # Gemma 3: attention's output normed first
            if o_bias:
                o = g.op("Add", [o, o_bias[0]], f"{p}.o_b")[0]
            o, o_bias = layers.fused_norm(g, form, o, block.post_attn, f"{p}.post_attn"), []
        # x + o (+ b_o) → x;  norm_2(x) → h
        h, x = layers.skip_norm(g, form, x, o, block.ln_2, o_bias, f"{p}.ln2", f"{p}.res1")
        # x + mlp(h) → x;  the next block's norm_1(x) (the final norm after the last) → h
        last = i + 1 == len(blocks)
        steer = None
        if token_rows is not None and i > 0:  # block 0's output is never steered
            layer_rows = g.op("Gather", [STEER, _scalar(g, f"{p}.steer_layer", i)],
                              f"{p}.steer_rows", axis=1)[0]  # (R, d)
            steer = g.op("Gather", [layer_rows, token_rows], f"{p}.steer", axis=0)[0]  # (N, d)
        h, x = layers.fused_mlp(g, form, x, h, block, gpt.ln_f if last else blocks[i + 1].ln_1,
                                p, "ln_f" if last else f"l{i + 1}.ln1", matmul_only, steer)
    if not logits_index:
        logits = layers.lm_head(g, form, gpt, h, matmul_only)  # (B·T, V)
        g.op("Reshape", [logits, shapes_btc[0]], "logits_bkv", outputs=[io.LOGITS])
        return _model(g, gpt, groups, logits_index, steering)
    hs_ = g.op("Split", [h, sizes], "h_split", n_out=len(groups), axis=0) if mixed else [h]
    picked, shapes_out = [], []
    for part, r, shape_btc in zip(hs_, groups, shapes_btc, strict=True):
        if r.tag:
            shape_btc = chunk.btd
        part = g.op("Reshape", [part, shape_btc], f"h_btd{r.tag}", **_exact(r))[0]  # (B, T, d)
        where = g.op("Unsqueeze", [r.index, g.const("axis_last", np.array([-1], np.int64))],
                     f"logits_index_bk1{r.tag}")[0]  # (B, K, 1)
        part = g.op("GatherND", [part, where], f"h_bkd{r.tag}", batch_dims=1)[0]  # (B, K, d)
        picked.append(g.op("Reshape", [part, flat], f"h_flat{r.tag}")[0])  # (B·K, d)
        index_shape = g.op("Shape", [r.index], f"index_shape{r.tag}")[0]  # [B, K]
        shapes_out.append(g.op("Concat", [index_shape, chunk.vocab if r.tag else minus1],
                               f"shape_bkc{r.tag}", axis=0)[0])  # [B, K, V or -1]
    h = g.op("Concat", picked, "h_picked", axis=0)[0] if mixed else picked[0]
    logits = layers.lm_head(g, form, gpt, h, matmul_only)  # (ΣB·K, V): the head read once
    if mixed:
        counts = _sizes(g, [r.index for r in groups], "picked")  # [B1·K1, B2·K2]
        parts = g.op("Split", [logits, counts], "logits_split", n_out=len(groups), axis=0)
    else:
        parts = [logits]
    for part, r, shape_out in zip(parts, groups, shapes_out, strict=True):
        g.op("Reshape", [part, shape_out], f"logits_bkv{r.tag}", outputs=[r.logits],
             **_exact(r))  # (B, K, V)
    return _model(g, gpt, groups, logits_index, steering)


def _token_rows(g: Graph, groups: list[_Rows]) -> str:
    """(N,) int64: the row of ``steer`` each flat token reads, in the flat order (the first
    group's B·T tokens, then the second's): its row in the pass, the second group's counted
    after the first's, modulo R, so the default one row of zeros serves every token."""
    one, zero = _scalar(g, "steer.one", 1), _scalar(g, "steer.zero", 0)
    flat_1d = g.const("steer.flat", np.array([-1], np.int64))
    per_group, offset = [], None
    for r in groups:
        bt = g.op("Shape", [r.ids], f"steer.bt{r.tag}")[0]  # [B, T]
        ones = g.op("ConstantOfShape", [bt], f"steer.ones{r.tag}",
                    value=helper.make_tensor("one", TensorProto.INT64, [1], [1]))[0]  # (B, T)
        rows = g.op("CumSum", [ones, zero], f"steer.counted{r.tag}")[0]  # (B, T): 1 … B
        rows = g.op("Sub", [rows, one], f"steer.rows_bt{r.tag}")[0]  # (B, T): 0 … B − 1
        rows = g.op("Reshape", [rows, flat_1d], f"steer.rows{r.tag}")[0]  # (B·T,)
        if offset is not None:  # the second group's rows follow the first's B
            rows = g.op("Add", [rows, offset], f"steer.rows_after{r.tag}")[0]
        per_group.append(rows)
        offset = g.op("Gather", [bt, zero], f"steer.b{r.tag}")[0]  # B, a scalar
    rows = per_group[0] if len(per_group) == 1 else g.op("Concat", per_group, "steer.rows_all",
                                                         axis=0)[0]  # (N,)
    count = g.op("Gather", [g.op("Shape", [STEER], "steer.shape")[0], zero],
                 "steer.r")[0]  # R
    return g.op("Mod", [rows, count], "steer.token_rows")[0]  # (N,)


def _scalar(g: Graph, name: str, value: int) -> str:
    """A 0-d int64 (an initializer's array would come out 1-d): Gather's index for a slice
    without the axis."""
    return g.op("Constant", [], name, value=helper.make_tensor(name, TensorProto.INT64, [],
                                                              [value]))[0]


class _ChunkShapes:
    """The mixed graph's second group may feed no token at all (a step with no chunk), so
    that a plain decode step runs the weight products on its own rows only (quantised
    MatMulNBits has a faster one-row kernel, and one more row costs it a quarter). Its
    GroupQueryAttention still needs a token: the group's rows get one zero row appended
    and are cut to T' = max(T, 1); the attention output is cut back to T. The reshapes
    name every dimension (a -1 cannot be inferred from zero elements)."""

    def __init__(self, g: Graph, rows: _Rows, width: int, d: int, vocab: int) -> None:
        self.g = g
        bt = g.op("Shape", [rows.ids], "chunk.bt")[0]  # [B, T]
        axis0 = g.const("chunk.zero", np.array([0], np.int64))
        self.btc = g.op("Concat", [bt, g.const("chunk.width", np.array([width], np.int64))],
                        "chunk.shape_btc", axis=0)[0]  # [B, T, width]
        self.btd = g.op("Concat", [bt, g.const("chunk.d", np.array([d], np.int64))],
                        "chunk.shape_btd", axis=0)[0]  # [B, T, d]
        self.vocab = g.const("chunk.vocab", np.array([vocab], np.int64))
        one = g.const("chunk.one", np.array([1], np.int64))
        batch = g.op("Slice", [bt, axis0, one], "chunk.b")[0]  # [B]
        self.t = g.op("Slice", [bt, one, g.const("chunk.two", np.array([2], np.int64))],
                      "chunk.t")[0]  # [T]
        self.t_pad = g.op("Max", [self.t, one], "chunk.t_padded")[0]  # [T']
        zero_row = g.const("chunk.zero_row", np.zeros((1, 1, width), np.float32))
        shape = g.op("Concat", [batch, one, g.const("chunk.width", np.array([width], np.int64))],
                     "chunk.shape_b1c", axis=0)[0]  # [B, 1, width]
        self.zeros = g.op("Expand", [zero_row, shape], "chunk.zeros")[0]  # (B, 1, width)
        self.axis1, self.start = one, g.const("chunk.zero", np.array([0], np.int64))

    def pad(self, qkv: str, name: str) -> str:
        g = self.g
        both = g.op("Concat", [qkv, self.zeros], f"{name}.with_zero", axis=1)[0]  # (B, T+1, ·)
        return g.op("Slice", [both, self.start, self.t_pad, self.axis1], name)[0]  # (B, T', ·)

    def unpad(self, attn: str, name: str) -> str:
        return self.g.op("Slice", [attn, self.start, self.t, self.axis1], name)[0]  # (B, T, d)


def _normed_qk(g: Graph, form: Description, qkv: str, attn: Any, p: str) -> str:
    """(N, nh·hs + 2·kv) with each head's query and key normalised over hs by the
    model's fused norm (GroupQueryAttention then rotates them), values as they were."""
    nh, nkv, hs = form.n_heads, form.kv_heads, form.head_dim
    q, k, v = g.op("Split", [qkv, g.const("split_q_k_v", np.array([nh * hs, nkv * hs, nkv * hs],
                                                                   np.int64))],
                   f"{p}.q_k_v", n_out=3, axis=-1)
    normed = []
    for part, heads, norm, kind in ((q, nh, attn.q_norm, "q"), (k, nkv, attn.k_norm, "k")):
        by_head = g.op("Reshape", [part, g.const(f"shape_heads{heads}",
                                                 np.array([-1, heads, hs], np.int64))],
                       f"{p}.{kind}_heads")[0]  # (N, heads, hs)
        by_head = layers.fused_norm(g, form, by_head, norm, f"{p}.{kind}_norm")  # (N, heads, hs)
        normed.append(g.op("Reshape", [by_head, g.const(f"shape_width{heads}", np.array(
            [-1, heads * hs], np.int64))], f"{p}.{kind}_normed")[0])  # (N, heads·hs)
    return g.op("Concat", [*normed, v], f"{p}.qkv_normed", axis=-1)[0]


def _exact(rows: _Rows) -> dict[str, Any]:
    """Reshape's attributes for the chunk group's shapes, which may hold a real 0 (no
    token): ``allowzero`` keeps it, where 0 would otherwise copy the input's dimension."""
    return {"allowzero": 1} if rows.tag else {}


def _sizes(g: Graph, tensors: list[str], name: str) -> str:
    """The element counts of ``tensors`` as one int64 vector: Split's sizes."""
    axis0 = g.const("axis0", np.array([0], np.int64))
    return g.op("Concat", [g.op("Unsqueeze", [g.op("Size", [t], f"{name}{j}")[0], axis0],
                                f"{name}{j}_1d")[0] for j, t in enumerate(tensors)],
                f"split_{name}", axis=0)[0]


def _model(g: Graph, gpt: GPT, groups: list[_Rows], logits_index: bool,
           steering: bool) -> onnx.ModelProto:
    """Wrap the nodes with the engine's I/O (engine_spec.py): a cache of kv heads; ``steer``
    an input with a default (an initializer of the same name: ONNX Runtime takes it when
    none is bound, and never folds it as a constant)."""
    cfg = gpt.config
    inputs, outputs = [], []
    if steering:
        g.const(STEER, np.zeros((1, cfg.n_layers, cfg.d_model), np.float32))
        inputs.append(helper.make_tensor_value_info(STEER, TensorProto.FLOAT,
                                                    [STEER_ROWS, cfg.n_layers, cfg.d_model]))
    for j, r in enumerate(groups):
        b, t = (io.BATCH, io.SEQUENCE) if j == 0 else (es.chunk_name(io.BATCH),
                                                       es.chunk_name(io.SEQUENCE))
        cached = MAX_SEQUENCE if j == 0 else es.chunk_name(MAX_SEQUENCE)
        kv: list[str | int] = [b, cfg.kv_heads, cached, cfg.head_dim]
        inputs += [
            helper.make_tensor_value_info(r.ids, TensorProto.INT64, [b, t]),
            helper.make_tensor_value_info(r.positions, TensorProto.INT64, [b, t]),
            helper.make_tensor_value_info(r.seqlens, TensorProto.INT32, [b]),
            helper.make_tensor_value_info(r.total, TensorProto.INT32, [1]),
            *[helper.make_tensor_value_info(n, TensorProto.FLOAT, kv) for n in r.past],
        ]
        positions = LOGITS_POSITIONS if logits_index else t
        if logits_index:
            if j:
                positions = es.chunk_name(LOGITS_POSITIONS)
            inputs.append(helper.make_tensor_value_info(r.index, TensorProto.INT64,
                                                        [b, positions]))
        outputs += [
            helper.make_tensor_value_info(r.logits, TensorProto.FLOAT,
                                          [b, positions, cfg.vocab_size]),
            *[helper.make_tensor_value_info(n, TensorProto.FLOAT, kv) for n in r.present],
        ]
    return make_model(g, "attnserve_engine", inputs, outputs, ENGINE_OPSET,
                      "attnserve engine decoder: GroupQueryAttention over an in-place KV "
                      "buffer; service-only, see export/onnx/engine_graph.py", contrib=True)


def export_engine(gpt: GPT, path: Path, logits_index: bool = True, mixed: bool = False) -> Path:
    """Write engine.onnx for ``gpt`` (float32 weights and cache)."""
    onnx.save_model(build_engine_graph(gpt, logits_index=logits_index, mixed=mixed), str(path))
    return path
