"""Build engine.onnx: the serving engine's own decoder graph, written node by node.

model.onnx follows the Hugging Face past/present convention, so every decode step
concatenates the whole cache into a new present tensor, and its attention is a dozen
small ops. engine.onnx keeps the same weights and arithmetic but runs attention in ONNX
Runtime's fused ``com.microsoft.GroupQueryAttention`` over a preallocated cache of
``max_seq_len`` positions that is both the past input and the present output: bound to the
same OrtValue, the kernel writes each new key/value in place and nothing is copied.

Each row's cache starts at position 0 (no left padding); ``seqlens_k`` (total length − 1
per row) tells the kernel where a row ends. GPT positions stay learned (or sinusoidal)
table lookups by ``position_ids``, outside the attention op; Llama-family models hand
the kernel their rotary cos/sin tables and their key/value head count instead. Only the
service uses this graph; model.onnx remains the contract graph for every other tool.

The I/O names and shapes are in service/contract/engine_spec.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from export.graphs import lm_head, qkv_bias, qkv_weight
from export.onnx_build import Graph, f32, make_model
from export.verify import (
    TorchReference,
    clear_mismatches,
    decode_prompts,
    logits_tolerance,
    top2_margin,
)
from model.gpt import GPT
from service.contract import io_spec as io
from service.contract.engine_spec import MAX_SEQUENCE, SEQLENS_K, TOTAL_SEQUENCE_LENGTH

ENGINE_OPSET = 18


def build_engine_graph(gpt: GPT, matmul_only: bool = False) -> onnx.ModelProto:
    """The decoder as fused ONNX Runtime nodes, weights from ``gpt``.

    ``matmul_only`` writes every weight product as a MatMul (a bias as a separate Add)
    instead of Gemm/FusedGemm, because weight quantisation (MatMulNBits) rewrites only
    MatMul nodes; the Adds are cheap elementwise ops over (N, ·).

    Hidden states stay flat, (N = B·T, d), so projections with a bias become one Gemm
    (FusedGemm with the ReLU folded in; BiasGelu or FastGelu take GELU's bias), and every
    residual add joins its LayerNorm in one SkipLayerNormalization, the output
    projections' biases included. Only attention sees
    (B, T, ·), through two reshapes that alias rather than copy.
    """
    cfg = gpt.config
    if cfg.arch == "llama":
        return _build_llama(gpt, matmul_only)
    nh, hs, d = cfg.n_heads, cfg.head_dim, cfg.d_model
    eps = float(cfg.layer_norm_eps)
    g = Graph()
    ms = "com.microsoft"
    tok = g.const("tok_emb", f32(gpt.tok_emb.weight))  # (V, d)
    blocks: list[Any] = list(gpt.blocks)
    pos_table: Any = gpt.pos_emb.weight if gpt.pos_emb is not None else gpt.pos_table
    pos = g.const("pos_emb", f32(pos_table))  # (L, d)
    ids_shape = g.op("Shape", [io.INPUT_IDS], "ids_shape")[0]  # [B, T]
    shape_btc = g.op("Concat", [ids_shape, g.const("minus1", np.array([-1], np.int64))],
                     "shape_btc", axis=0)[0]  # [B, T, -1]
    flat = g.const("shape_flat", np.array([-1, d], np.int64))  # [N, d]
    embed = g.op("Add", [g.op("Gather", [tok, io.INPUT_IDS], "tok_gather")[0],
                         g.op("Gather", [pos, io.POSITION_IDS], "pos_gather")[0]], "embed")[0]
    x = g.op("Reshape", [embed, flat], "embed_flat")[0]  # (N, d)
    h = g.op("LayerNormalization", [x, g.const("l0.ln1.w", f32(blocks[0].ln_1.weight)),
                                    g.const("l0.ln1.b", f32(blocks[0].ln_1.bias))],
             "l0.ln1", axis=-1, epsilon=eps)[0]  # (N, d)
    n_layers = len(blocks)
    for i, block in enumerate(blocks):
        a, ffn, p = block.attn, block.ffn, f"l{i}"
        w_qkv = qkv_weight(a)  # (d, 3d): q | k | v
        if cfg.attn_bias:  # GPT-2: one Gemm adds the q | k | v biases
            b_qkv = qkv_bias(a)
            assert b_qkv is not None
            if matmul_only:
                qkv = g.op("Add", [g.op("MatMul", [h, g.const(f"{p}.w_qkv", w_qkv)],
                                        f"{p}.qkv_mm")[0], g.const(f"{p}.b_qkv", b_qkv)],
                           f"{p}.qkv")[0]  # (N, 3d)
            else:
                qkv = g.op("Gemm", [h, g.const(f"{p}.w_qkv", w_qkv),
                                    g.const(f"{p}.b_qkv", b_qkv)], f"{p}.qkv")[0]  # (N, 3d)
        else:
            qkv = g.op("MatMul", [h, g.const(f"{p}.w_qkv", w_qkv)], f"{p}.qkv")[0]  # (N, 3d)
        qkv = g.op("Reshape", [qkv, shape_btc], f"{p}.qkv_btc")[0]  # (B, T, 3d)
        attn = g.op(
            "GroupQueryAttention",
            [qkv, "", "", io.past_key_name(i), io.past_value_name(i), SEQLENS_K,
             TOTAL_SEQUENCE_LENGTH],
            f"{p}.gqa", outputs=[f"{p}.attn", io.present_key_name(i), io.present_value_name(i)],
            domain=ms, num_heads=nh, kv_num_heads=nh, scale=float(1.0 / np.sqrt(hs)),
            do_rotary=0)[0]  # (B, T, d)
        attn = g.op("Reshape", [attn, flat], f"{p}.attn_flat")[0]  # (N, d)
        o = g.op("MatMul", [attn, g.const(f"{p}.w_o", f32(a.w_o.weight).T)], f"{p}.o")[0]
        # x + o (+ b_o) → x;  LN_2(x) → h
        o_bias = [g.const(f"{p}.b_o", f32(a.w_o.bias))] if cfg.attn_bias else []
        h, x = g.op("SkipLayerNormalization",
                    [x, o, g.const(f"{p}.ln2.w", f32(block.ln_2.weight)),
                     g.const(f"{p}.ln2.b", f32(block.ln_2.bias)), *o_bias],
                    f"{p}.ln2", outputs=[f"{p}.ln2", "", "", f"{p}.res1"], domain=ms,
                    epsilon=eps)[0::3]
        up_w, up_b = g.const(f"{p}.up.w", f32(ffn.up.weight).T), g.const(f"{p}.up.b",
                                                                         f32(ffn.up.bias))
        if cfg.activation == "relu" and matmul_only:
            up = g.op("Add", [g.op("MatMul", [h, up_w], f"{p}.up_mm")[0], up_b], f"{p}.up")[0]
            act = g.op("Relu", [up], f"{p}.act")[0]  # (N, d_ff)
        elif cfg.activation == "relu":
            act = g.op("FusedGemm", [h, up_w, up_b], f"{p}.up", domain=ms,
                       activation="Relu")[0]  # (N, d_ff)
        elif cfg.activation == "gelu_tanh":  # GPT-2's tanh approximation, bias folded in
            up = g.op("MatMul", [h, up_w], f"{p}.up")[0]
            act = g.op("FastGelu", [up, up_b], f"{p}.act", domain=ms)[0]
        else:  # exact (erf) GELU, as nn.GELU()
            up = g.op("MatMul", [h, up_w], f"{p}.up")[0]
            act = g.op("BiasGelu", [up, up_b], f"{p}.act", domain=ms)[0]
        down = g.op("MatMul", [act, g.const(f"{p}.down.w", f32(ffn.down.weight).T)],
                    f"{p}.down")[0]  # (N, d), bias added inside the next SkipLayerNorm
        ln = blocks[i + 1].ln_1 if i + 1 < n_layers else gpt.ln_f
        q = f"l{i + 1}.ln1" if i + 1 < n_layers else "ln_f"
        # x + down + b_down → x;  next LN(x) → h
        h, x = g.op("SkipLayerNormalization",
                    [x, down, g.const(f"{q}.w", f32(ln.weight)), g.const(f"{q}.b", f32(ln.bias)),
                     g.const(f"{p}.down.b", f32(ffn.down.bias))],
                    q, outputs=[q, "", "", f"{p}.res2"], domain=ms, epsilon=eps)[0::3]
    logits = lm_head(g, gpt, h, matmul_only)  # (N, V)
    g.op("Reshape", [logits, shape_btc], "logits_btv", outputs=[io.LOGITS])  # (B, T, V)
    return _model(g, gpt)


def _model(g: Graph, gpt: GPT) -> onnx.ModelProto:
    """Wrap the nodes with the engine's I/O (engine_spec.py): a cache of kv heads."""
    cfg = gpt.config
    kv: list[str | int] = [io.BATCH, cfg.kv_heads, MAX_SEQUENCE, cfg.head_dim]
    inputs = [
        helper.make_tensor_value_info(io.INPUT_IDS, TensorProto.INT64, [io.BATCH, io.SEQUENCE]),
        helper.make_tensor_value_info(io.POSITION_IDS, TensorProto.INT64,
                                      [io.BATCH, io.SEQUENCE]),
        helper.make_tensor_value_info(SEQLENS_K, TensorProto.INT32, [io.BATCH]),
        helper.make_tensor_value_info(TOTAL_SEQUENCE_LENGTH, TensorProto.INT32, [1]),
        *[helper.make_tensor_value_info(n, TensorProto.FLOAT, kv)
          for n in io.past_names(cfg.n_layers)],
    ]
    outputs = [
        helper.make_tensor_value_info(io.LOGITS, TensorProto.FLOAT,
                                      [io.BATCH, io.SEQUENCE, cfg.vocab_size]),
        *[helper.make_tensor_value_info(n, TensorProto.FLOAT, kv)
          for n in io.present_names(cfg.n_layers)],
    ]
    return make_model(g, "attnserve_engine", inputs, outputs, ENGINE_OPSET,
                      "attnserve engine decoder: GroupQueryAttention over an in-place KV "
                      "buffer; service-only, see export/engine_graph.py", contrib=True)


def _build_llama(gpt: GPT, matmul_only: bool = False) -> onnx.ModelProto:
    """The Llama-family decoder: RMSNorm as (Skip)SimplifiedLayerNormalization, SwiGLU,
    and GroupQueryAttention with ``kv_num_heads`` key/value heads rotating Q and K itself
    (``do_rotary``, cos/sin tables of max_seq_len rows computed as model/rotary.py does).

    The kernel takes each token's rotary position from its row's cache length, so rows
    start at position 0 and ``position_ids`` is not read; the input stays for the
    engine's uniform I/O.
    """
    import torch

    cfg = gpt.config
    nh, nkv, hs, d = cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.d_model
    eps = float(cfg.layer_norm_eps)
    g = Graph()
    ms = "com.microsoft"
    assert gpt.rotary is not None
    inv_freq: torch.Tensor = gpt.rotary.inv_freq  # type: ignore[assignment]
    with torch.no_grad():
        angles = torch.arange(cfg.max_seq_len)[:, None].float() * inv_freq  # (L, hs/2)
    cos = g.const("rope.cos", f32(angles.cos()))  # (L, hs/2)
    sin = g.const("rope.sin", f32(angles.sin()))  # (L, hs/2)
    blocks: list[Any] = list(gpt.blocks)
    ids_shape = g.op("Shape", [io.INPUT_IDS], "ids_shape")[0]  # [B, T]
    shape_btc = g.op("Concat", [ids_shape, g.const("minus1", np.array([-1], np.int64))],
                     "shape_btc", axis=0)[0]  # [B, T, -1]
    flat = g.const("shape_flat", np.array([-1, d], np.int64))  # [N, d]
    embed = g.op("Gather", [g.const("tok_emb", f32(gpt.tok_emb.weight)), io.INPUT_IDS],
                 "tok_gather")[0]  # (B, T, d)
    x = g.op("Reshape", [embed, flat], "embed_flat")[0]  # (N, d)
    h = g.op("SimplifiedLayerNormalization", [x, g.const("l0.ln1.w",
                                                         f32(blocks[0].ln_1.weight))],
             "l0.ln1", axis=-1, epsilon=eps)[0]  # (N, d)

    def affine(inp: str, w: str, b: str | None, name: str) -> str:
        """inp·w (+ b): one Gemm, or MatMul + Add where weight quantisation must see it."""
        if b is None:
            return g.op("MatMul", [inp, w], name)[0]
        if matmul_only:
            return g.op("Add", [g.op("MatMul", [inp, w], f"{name}.mm")[0], b], name)[0]
        return g.op("Gemm", [inp, w, b], name)[0]

    def linear(inp: str, layer: Any, name: str, bias: bool) -> str:
        w = g.const(f"{name}.w", f32(layer.weight).T)  # (in, out)
        return affine(inp, w, g.const(f"{name}.b", f32(layer.bias)) if bias else None, name)

    for i, block in enumerate(blocks):
        a, ffn, p = block.attn, block.ffn, f"l{i}"
        w_qkv = qkv_weight(a)  # (d, d + 2·kv): q | k | v
        raw_b_qkv = qkv_bias(a)  # Qwen2 biases q | k | v
        b_qkv = None if raw_b_qkv is None else g.const(f"{p}.b_qkv", raw_b_qkv)
        qkv = affine(h, g.const(f"{p}.w_qkv", w_qkv), b_qkv, f"{p}.qkv")  # (N, d + 2·kv)
        qkv = g.op("Reshape", [qkv, shape_btc], f"{p}.qkv_btc")[0]  # (B, T, d + 2·kv)
        attn = g.op(
            "GroupQueryAttention",
            [qkv, "", "", io.past_key_name(i), io.past_value_name(i), SEQLENS_K,
             TOTAL_SEQUENCE_LENGTH, cos, sin],
            f"{p}.gqa", outputs=[f"{p}.attn", io.present_key_name(i), io.present_value_name(i)],
            domain=ms, num_heads=nh, kv_num_heads=nkv, scale=float(1.0 / np.sqrt(hs)),
            do_rotary=1, rotary_interleaved=0)[0]  # (B, T, d)
        attn = g.op("Reshape", [attn, flat], f"{p}.attn_flat")[0]  # (N, d)
        o = g.op("MatMul", [attn, g.const(f"{p}.w_o", f32(a.w_o.weight).T)], f"{p}.o")[0]
        o_bias = [g.const(f"{p}.b_o", f32(a.w_o.bias))] if a.w_o.bias is not None else []
        # x + o (+ b_o) → x;  RMSNorm_2(x) → h
        h, x = g.op("SkipSimplifiedLayerNormalization",
                    [x, o, g.const(f"{p}.ln2.w", f32(block.ln_2.weight)), *o_bias],
                    f"{p}.ln2", outputs=[f"{p}.ln2", "", "", f"{p}.res1"], domain=ms,
                    epsilon=eps)[0::3]
        bias = cfg.mlp_bias
        gate = linear(h, ffn.gate, f"{p}.gate", bias)  # (N, d_ff)
        silu = g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{p}.sig")[0]], f"{p}.silu")[0]
        act = g.op("Mul", [silu, linear(h, ffn.up, f"{p}.up", bias)], f"{p}.glu")[0]
        down = g.op("MatMul", [act, g.const(f"{p}.down.w", f32(ffn.down.weight).T)],
                    f"{p}.down")[0]  # (N, d)
        down_bias = [g.const(f"{p}.down.b", f32(ffn.down.bias))] if bias else []
        ln = blocks[i + 1].ln_1 if i + 1 < len(blocks) else gpt.ln_f
        q = f"l{i + 1}.ln1" if i + 1 < len(blocks) else "ln_f"
        h, x = g.op("SkipSimplifiedLayerNormalization",
                    [x, down, g.const(f"{q}.w", f32(ln.weight)), *down_bias],
                    q, outputs=[q, "", "", f"{p}.res2"], domain=ms, epsilon=eps)[0::3]
    logits = lm_head(g, gpt, h, matmul_only)  # (N, V)
    g.op("Reshape", [logits, shape_btc], "logits_btv", outputs=[io.LOGITS])  # (B, T, V)
    return _model(g, gpt)


def export_engine(gpt: GPT, path: Path, matmul_only: bool = False) -> Path:
    """Write engine.onnx for ``gpt`` (float32 weights and cache)."""
    onnx.save_model(build_engine_graph(gpt, matmul_only), str(path))
    return path


def verify_engine(gpt: GPT, path: Path, steps: int = 64, tolerance: float | None = None,
                  prompts: list[list[int]] | None = None,
                  reference: TorchReference | None = None) -> dict[str, object]:
    """Greedy-decode ragged rows through engine.onnx, teacher-forced with PyTorch's tokens;
    logits within tolerance, greedy choices equal wherever PyTorch's choice is clear.

    Pass model.onnx's ``reference`` and decode ``prompts`` and PyTorch runs no more.
    Also checks that the presents come back in the very buffers bound as pasts, i.e. that
    ONNX Runtime really updated the cache in place.
    """
    import onnxruntime as ort

    from service.contract.sessions import create_session

    cfg = gpt.config
    n = cfg.n_layers
    if prompts is None:
        prompts = decode_prompts(np.random.default_rng(0), cfg.vocab_size)
    steps = max(1, min(steps, cfg.max_seq_len - max(len(p) for p in prompts)))
    reference = reference or TorchReference(gpt)
    seqs, refs = zip(*(reference.greedy(p, steps) for p in prompts), strict=True)
    session = create_session(path)
    lens = [len(p) for p in prompts]
    shape = (len(lens), cfg.kv_heads, cfg.max_seq_len, cfg.head_dim)
    buffers = [ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32)) for _ in range(2 * n)]
    t = max(lens)
    ids = np.zeros((len(lens), t), np.int64)  # right-padded: each row's cache starts at 0
    for row, p in enumerate(prompts):
        ids[row, :len(p)] = p
    pos = np.tile(np.arange(t, dtype=np.int64), (len(lens), 1))
    total = np.asarray(lens, np.int64)
    worst, in_place, scale = 0.0, True, 0.0
    margins: list[float] = []  # the reference's top-2 margin where the argmax differed
    for step in range(steps):
        binding = session.io_binding()
        binding.bind_output(io.LOGITS, "cpu")
        binding.bind_cpu_input(io.INPUT_IDS, ids)
        binding.bind_cpu_input(io.POSITION_IDS, pos)
        binding.bind_cpu_input(SEQLENS_K, (total - 1).astype(np.int32))
        binding.bind_cpu_input(TOTAL_SEQUENCE_LENGTH,
                               np.array([t if step == 0 else int(total.max())], np.int32))
        for name, value in zip(io.past_names(n), buffers, strict=True):
            binding.bind_ortvalue_input(name, value)
        for name, value in zip(io.present_names(n), buffers, strict=True):
            binding.bind_ortvalue_output(name, value)
        session.run_with_iobinding(binding)
        outs = binding.get_outputs()
        in_place &= all(o.data_ptr() == b.data_ptr() for o, b in zip(outs[1:], buffers,
                                                                      strict=True))
        logits = outs[0].numpy()  # (B, T, V)
        last = logits[np.arange(len(lens)), total - 1 if step == 0 else 0]  # (B, V)
        ref = np.stack([r[k - 1 + step] for r, k in zip(refs, lens, strict=True)])  # (B, V)
        worst = max(worst, float(np.abs(last - ref).max()))
        scale = max(scale, float(np.abs(ref).max()))
        margins += [top2_margin(ref[row]) for row in np.flatnonzero(
            last.argmax(-1) != ref.argmax(-1))]
        nxt = np.array([s[k + step] for s, k in zip(seqs, lens, strict=True)], np.int64)
        ids, pos = nxt[:, None], total[:, None].copy()  # PyTorch's tokens: the same cache
        total = total + 1
    if tolerance is None:
        tolerance = logits_tolerance(cfg, scale)
    decided = clear_mismatches(margins, tolerance)
    result: dict[str, object] = {"steps": steps, "max_abs_diff": worst,
                                 "greedy_equal": not decided, "near_ties": len(margins)
                                 - len(decided), "in_place": in_place, "tolerance": tolerance,
                                 "prompt_lengths": lens}
    if not (worst <= tolerance and not decided and in_place):
        raise ValueError(f"engine.onnx disagrees with PyTorch: {result}")
    return result


class EngineDecoder:
    """engine.onnx behind OrtDecoder's call shape, so export/quantize.py can judge an int8
    engine graph the way it judges model.onnx.

    The past is opaque here: the static (B, nkv, max_seq_len, hs) buffers (key/value heads,
    as the service's KV pool holds them) and each row's length. Rows must be unpadded and
    of equal length (the quantisation checks are).
    """

    def __init__(self, path: Path, gpt: GPT, threads: int = 1) -> None:
        from service.contract.sessions import create_session

        self.session = create_session(path, threads=threads)
        self.config = gpt.config

    def empty_past(self, batch: int) -> tuple[list[np.ndarray], np.ndarray]:
        cfg = self.config
        shape = (batch, cfg.kv_heads, cfg.max_seq_len, cfg.head_dim)  # (B, nkv, L, hs)
        zeros = [np.zeros(shape, np.float32) for _ in range(2 * cfg.n_layers)]
        return zeros, np.zeros(batch, np.int64)

    def __call__(self, ids: np.ndarray, mask: np.ndarray, pos: np.ndarray,
                 past: tuple[list[np.ndarray], np.ndarray]
                 ) -> tuple[np.ndarray, tuple[list[np.ndarray], np.ndarray]]:
        if not mask.all():
            raise ValueError("EngineDecoder takes unpadded rows only")
        buffers, lengths = past
        total = lengths + ids.shape[1]  # (B,)
        n = self.config.n_layers
        feed = {io.INPUT_IDS: ids, io.POSITION_IDS: pos,
                SEQLENS_K: (total - 1).astype(np.int32),
                TOTAL_SEQUENCE_LENGTH: np.array([int(total.max())], np.int32),
                **dict(zip(io.past_names(n), buffers, strict=True))}
        logits, *present = self.session.run([io.LOGITS, *io.present_names(n)], feed)
        return logits, (present, total)  # logits (B, T, V)
