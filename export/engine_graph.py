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
same for every family; the embeddings, norms, Q/K/V projection and MLP nodes are the
architecture's (model/architectures/). Only the service uses this graph; model.onnx
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

from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from export.graphs import lm_head
from export.onnx_build import Graph, f32, make_model
from export.verify import (
    TorchReference,
    clear_mismatches,
    decode_prompts,
    logits_tolerance,
    top2_margin,
)
from model.architectures import architecture
from model.architectures.base import CONTRIB
from model.gpt import GPT
from service.contract import io_spec as io
from service.contract.engine_spec import (
    LOGITS_INDEX,
    LOGITS_POSITIONS,
    MAX_SEQUENCE,
    SEQLENS_K,
    TOTAL_SEQUENCE_LENGTH,
)

ENGINE_OPSET = 18


def build_engine_graph(gpt: GPT, matmul_only: bool = False,
                       logits_index: bool = True) -> onnx.ModelProto:
    """The decoder as fused ONNX Runtime nodes, weights from ``gpt``, for every family.

    ``logits_index=False`` writes the graph as exported before that input existed (logits
    of every fed position), which the service still serves; only tests build it now.

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
    arch = architecture(cfg.arch)
    nh, hs, d = cfg.n_heads, cfg.head_dim, cfg.d_model
    eps = float(cfg.layer_norm_eps)
    g = Graph()
    rotary = arch.engine_tables(g, gpt)  # (cos, sin) for GroupQueryAttention, or None
    ids_shape = g.op("Shape", [io.INPUT_IDS], "ids_shape")[0]  # [B, T]
    shape_btc = g.op("Concat", [ids_shape, g.const("minus1", np.array([-1], np.int64))],
                     "shape_btc", axis=0)[0]  # [B, T, -1]
    flat = g.const("shape_flat", np.array([-1, d], np.int64))  # [N, d]
    embed = arch.engine_embed(g, gpt, io.INPUT_IDS, io.POSITION_IDS)  # (B, T, d)
    x = g.op("Reshape", [embed, flat], "embed_flat")[0]  # (N, d)
    blocks: list[Any] = list(gpt.blocks)
    h = arch.engine_norm(g, x, blocks[0].ln_1, eps, "l0.ln1")  # (N, d)
    rope: dict[str, int] = {"do_rotary": 0}
    if rotary is not None:  # the kernel rotates Q and K by each row's cache position
        rope = {"do_rotary": 1, "rotary_interleaved": 0}
    for i, block in enumerate(blocks):
        a, p = block.attn, f"l{i}"
        qkv = arch.engine_qkv(g, h, a, p, matmul_only)  # (N, d + 2·kv): q | k | v
        qkv = g.op("Reshape", [qkv, shape_btc], f"{p}.qkv_btc")[0]  # (B, T, d + 2·kv)
        attn = g.op(
            "GroupQueryAttention",
            [qkv, "", "", io.past_key_name(i), io.past_value_name(i), SEQLENS_K,
             TOTAL_SEQUENCE_LENGTH, *(rotary or ())],
            f"{p}.gqa", outputs=[f"{p}.attn", io.present_key_name(i), io.present_value_name(i)],
            domain=CONTRIB, num_heads=nh, kv_num_heads=cfg.kv_heads,
            scale=float(1.0 / np.sqrt(hs)), **rope)[0]  # (B, T, d)
        attn = g.op("Reshape", [attn, flat], f"{p}.attn_flat")[0]  # (N, d)
        o = g.op("MatMul", [attn, g.const(f"{p}.w_o", f32(a.w_o.weight).T)], f"{p}.o")[0]
        o_bias = [g.const(f"{p}.b_o", f32(a.w_o.bias))] if a.w_o.bias is not None else []
        # x + o (+ b_o) → x;  norm_2(x) → h
        h, x = arch.engine_skip_norm(g, x, o, block.ln_2, o_bias, eps, f"{p}.ln2",
                                     f"{p}.res1")
        # x + mlp(h) → x;  the next block's norm_1(x) (the final norm after the last) → h
        last = i + 1 == len(blocks)
        h, x = arch.engine_mlp(g, cfg, x, h, block.ffn, gpt.ln_f if last else blocks[i + 1].ln_1,
                               p, "ln_f" if last else f"l{i + 1}.ln1", matmul_only)
    shape_out = shape_btc  # [B, T, -1]
    if logits_index:
        h = g.op("Reshape", [h, shape_btc], "h_btd")[0]  # (B, T, d)
        where = g.op("Unsqueeze", [LOGITS_INDEX, g.const("axis_last", np.array([-1], np.int64))],
                     "logits_index_bk1")[0]  # (B, K, 1)
        h = g.op("GatherND", [h, where], "h_bkd", batch_dims=1)[0]  # (B, K, d)
        h = g.op("Reshape", [h, flat], "h_flat")[0]  # (B·K, d)
        index_shape = g.op("Shape", [LOGITS_INDEX], "index_shape")[0]  # [B, K]
        shape_out = g.op("Concat", [index_shape, g.const("minus1", np.array([-1], np.int64))],
                         "shape_bkc", axis=0)[0]  # [B, K, -1]
    logits = lm_head(g, gpt, h, matmul_only)  # (B·K, V)
    g.op("Reshape", [logits, shape_out], "logits_bkv", outputs=[io.LOGITS])  # (B, K, V)
    return _model(g, gpt, logits_index)


def _model(g: Graph, gpt: GPT, logits_index: bool) -> onnx.ModelProto:
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
    if logits_index:
        inputs.append(helper.make_tensor_value_info(LOGITS_INDEX, TensorProto.INT64,
                                                    [io.BATCH, LOGITS_POSITIONS]))
    positions = LOGITS_POSITIONS if logits_index else io.SEQUENCE
    outputs = [
        helper.make_tensor_value_info(io.LOGITS, TensorProto.FLOAT,
                                      [io.BATCH, positions, cfg.vocab_size]),
        *[helper.make_tensor_value_info(n, TensorProto.FLOAT, kv)
          for n in io.present_names(cfg.n_layers)],
    ]
    return make_model(g, "attnserve_engine", inputs, outputs, ENGINE_OPSET,
                      "attnserve engine decoder: GroupQueryAttention over an in-place KV "
                      "buffer; service-only, see export/engine_graph.py", contrib=True)


def export_engine(gpt: GPT, path: Path, matmul_only: bool = False,
                  logits_index: bool = True) -> Path:
    """Write engine.onnx for ``gpt`` (float32 weights and cache)."""
    onnx.save_model(build_engine_graph(gpt, matmul_only, logits_index), str(path))
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
        last_fed = total - 1 if step == 0 else np.zeros_like(total)  # (B,) prompt end, then 0
        binding.bind_cpu_input(LOGITS_INDEX, last_fed[:, None])  # (B, 1)
        for name, value in zip(io.past_names(n), buffers, strict=True):
            binding.bind_ortvalue_input(name, value)
        for name, value in zip(io.present_names(n), buffers, strict=True):
            binding.bind_ortvalue_output(name, value)
        session.run_with_iobinding(binding)
        outs = binding.get_outputs()
        in_place &= all(o.data_ptr() == b.data_ptr() for o, b in zip(outs[1:], buffers,
                                                                      strict=True))
        last = outs[0].numpy()[:, 0]  # (B, V)
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
    of equal length (the quantisation checks are); every fed position gets its logits.
    """

    def __init__(self, path: Path, gpt: GPT, threads: int = 1) -> None:
        from service.contract.sessions import create_session

        self.session = create_session(path, threads=threads)
        self.config = gpt.config
        self._gathers = LOGITS_INDEX in {i.name for i in self.session.get_inputs()}

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
        if self._gathers:  # every position's logits, as model.onnx gives them
            feed[LOGITS_INDEX] = np.tile(np.arange(ids.shape[1], dtype=np.int64), (len(ids), 1))
        logits, *present = self.session.run([io.LOGITS, *io.present_names(n)], feed)
        return logits, (present, total)  # logits (B, T, V)
