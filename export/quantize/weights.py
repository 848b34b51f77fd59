"""Weight quantisation of the decoder graphs and the figures that judge it.

Four methods, all leaving embeddings, LayerNorms, attention and the KV cache in float32
so the I/O contract is unchanged:

- ``int4``: the same ``MatMulNBits`` with 4-bit codes, asymmetric (a zero point per
  block of 32), int8 activations. Chosen by measurement on SmolLM2-135M-Instruct
  (benchmarks/quant_blocks.py, docs/export.md): level 4 beat level 0 on speed at every
  block size; block 32 with zero points had the lowest perplexity of the blocks that run
  at int8's speed or better (block 16 is slower at batch 8; 64 and 128 lose 4-14% more).
- ``int8``: ONNX Runtime's block-quantised ``MatMulNBits`` (what
  onnxruntime-genai uses on CPU): every MatMul weight becomes 8-bit, symmetric, one scale
  per block of 32 input rows, and ``accuracy_level=4`` lets the kernel quantise the
  activations to int8 per block and run an int8 dot product. The weights are read once,
  packed, at session start; nothing is re-quantised per call except one activation row.
- ``int8-dynamic``: ``quantize_dynamic`` (per-output-channel int8 weights, activations
  quantised on the fly for MatMulInteger), its activation scales then made one per row
  (export/quantize/dynamic_rows.py) so that a row's logits do not depend on its batch.
- ``gguf``: for a checkpoint imported from a GGUF file, that file's own Q4_0 / Q4_1 /
  Q5_0 / Q5_1 / Q8_0 and K-quant (Q2_K-Q6_K) blocks, not requantised: as stored, under
  our GgufMatMul op (``--kernel ggml``), or as MatMulNBits (``nbits``; export/gguf/blocks.py);
  weights with float tensors (F16, BF16) fall back to ``int8`` one by one.

Quantisation runs on the graph as exported, before ORT's fusions, so every weight MatMul
is still a plain MatMul with a constant right-hand side. Logits no longer match PyTorch
to 1e-4, so int8 is judged differently, on held-out text:

- token agreement: the float32 graph decodes greedily for 64 steps; the int8 graph is fed
  the same tokens through its KV cache and we count the steps where its argmax agrees;
- the length of the common prefix when the int8 graph decodes freely;
- validation perplexity of both graphs on held-out windows, and its relative change.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from export.gguf.source import GGUFFile, open_source
from export.memory import release
from model.gpt import GPT
from service.contract.reference import Decoder, agreement_with, greedy

METHODS = ("int8", "int4", "int8-dynamic", "gguf")
# Block-wise 8-bit weights lose ~10x less than per-channel dynamic int8, so they are held
# to a higher bar.
# 4-bit codes keep 16 levels a block: held to a lower bar still.
# gguf keeps the file's weights: only its int8 activations differ from the float32 graph.
AGREEMENT_TARGETS = {"int8": 0.97, "int4": 0.85, "int8-dynamic": 0.95, "gguf": 0.95}
BLOCK_SIZE = 32
ACCURACY_LEVEL = 4  # int8 activations, int8 dot products
# attention.onnx of a quantised artifact reads the served weights at float activations:
# what /attention shows is the weights' attention, not int8 activations' rounding (its
# speed matters little: one pass a request for the layers asked)
ATTENTION_ACCURACY_LEVEL = 0
# --activations: MatMulNBits' accuracy level for the served graphs (--quantize gguf)
ACTIVATION_LEVELS = {"int8": ACCURACY_LEVEL, "float": 0}
# MatMulNBits settings per method: (bits, symmetric).
NBITS = {"int8": (8, True), "int4": (4, False)}
STEPS = 64
SIDE_DATA = ".data"  # a quantised graph's new weights beside it (_save), until weights.bin
PROMPTS = 8
PROMPT_TOKENS = 16
FALLBACK_TEXT = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
    "with a single step. To be, or not to be, that is the question. All that glitters is "
    "not gold. Knowledge is power, and time is money. Where there is a will there is a way. "
) * 8


def gguf_advice(training: dict[str, Any], method: str | None) -> str | None:
    """A note for ``--quantize int4|int8`` of a checkpoint imported from a GGUF file whose
    matrices are blocks that ``--quantize gguf`` keeps as they are: int4/int8 re-round
    weights that are already quantised (SmolLM2's Q4_1 file: +33% perplexity with int4,
    +0.3% with gguf). None where it does not apply."""
    record = training.get("imported_from")
    if method not in NBITS or not isinstance(record, dict) or record.get("format") != "gguf":
        return None
    from export.gguf.blocks import DIRECT  # the types it keeps

    types = record.get("tensor_types")
    kept = sorted({t.name for t in DIRECT} & set(types)) if isinstance(types, dict) else []
    if not kept:
        return None
    return (f"note: this checkpoint was imported from a GGUF file of {'/'.join(kept)} blocks; "
            f"--quantize {method} quantises those already-quantised weights again, while "
            "--quantize gguf keeps them exactly (the file's own quality)")


def held_out_text(training: dict[str, Any]) -> tuple[str, str]:
    """The held-out tail (last 10%) of the checkpoint's own corpus; (text, source).

    ``training`` is the checkpoint's training record: its ``data_path`` (or ``data``) names
    the corpus, and ``stdlib`` is rebuilt from this Python's standard library. A corpus that
    is gone falls back to the stdlib corpus, and that to a fixed text.
    """
    from model.data import STDLIB, stdlib_corpus_path

    for key in ("data_path", "data", "corpus", "corpus_path"):
        value = training.get(key)
        if value == STDLIB:
            path, name = stdlib_corpus_path(), "stdlib corpus"
        elif isinstance(value, str) and Path(value).is_file():
            path, name = Path(value), value
        else:
            continue
        text = path.read_text("utf-8", errors="replace")
        return text[int(len(text) * 0.9):], f"{name} (last 10%)"
    try:
        text = stdlib_corpus_path().read_text("utf-8", errors="replace")
        return text[int(len(text) * 0.9):], "stdlib corpus (last 10%)"
    except OSError:
        return FALLBACK_TEXT, "built-in fixed prompt text"


def _run_all(dec: Decoder, ids: np.ndarray) -> np.ndarray:
    b, t = ids.shape
    pos = np.broadcast_to(np.arange(t, dtype=np.int64), (b, t)).copy()
    logits, _ = dec(ids, np.ones_like(ids), pos, dec.empty_past(b))
    return logits  # (B, T, V)


def perplexity(dec: Decoder, windows: np.ndarray) -> float:
    """exp(mean NLL) of each window's tokens after the first. One window a pass: the
    logits of a window are bit for bit those of a batch of all (checked on every graph
    kind of a --quantize gguf export), and a pass holds (T, V) logits, not (B, T, V) and
    the arena and float64 copies around them (1 GB more at SmolLM2's 49k vocabulary)."""
    nll = np.empty(windows[:, 1:].shape)  # (B, T) float64
    for row, window in enumerate(windows):
        x = _run_all(dec, window[None, :-1])[0].astype(np.float64)  # (T, V)
        x -= x.max(-1, keepdims=True)
        logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
        nll[row] = -np.take_along_axis(logp, window[1:, None], axis=-1)[:, 0]
    return float(math.exp(nll.mean()))


def compare_decoders(gpt: GPT, reference: Callable[[], Decoder],
                     candidate: Callable[[], Decoder], tokenizer: Any,
                     training: dict[str, Any], method: str = "int8") -> dict[str, Any]:
    """Agreement and perplexity of a quantised decoder against its float32 reference.

    ``reference`` and ``candidate`` make the decoders, one after the other: each session
    (a float32 one holds every weight unpacked) is gone before the next is made."""
    cfg = gpt.config
    text, source = held_out_text(training)
    ids = np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, np.int64)
    steps = min(STEPS, cfg.max_seq_len - PROMPT_TOKENS)
    target = AGREEMENT_TARGETS[method]

    stride = max(PROMPT_TOKENS, (len(ids) - PROMPT_TOKENS) // PROMPTS)
    prompts = np.stack([ids[i * stride:i * stride + PROMPT_TOKENS] for i in range(PROMPTS)])
    window = min(cfg.max_seq_len, 128) + 1
    count = max(1, min(8, len(ids) // window))
    windows = np.stack([ids[i * window:(i + 1) * window] for i in range(count)])

    release()  # what quantising left behind, before a float32 session comes
    dec = reference()
    expected = greedy(dec, prompts, steps)
    ppl_ref = perplexity(dec, windows)
    del dec
    release()
    dec = candidate()
    agreement = agreement_with(dec, prompts, expected)
    ppl_q = perplexity(dec, windows)
    del dec
    release()
    return {
        "held_out_source": source,
        "prompts": PROMPTS,
        "steps": steps,
        "token_agreement": round(agreement["token_agreement"], 4),
        "agreement_target": target,
        "meets_target": agreement["token_agreement"] >= target,
        "free_running_mean_common_prefix": round(agreement["free_running_mean_common_prefix"],
                                                 2),
        "perplexity_fp32": round(ppl_ref, 4),
        "perplexity_quantized": round(ppl_q, 4),
        "perplexity_relative_change": round(ppl_q / ppl_ref - 1.0, 5),
        "perplexity_tokens": int(windows[:, 1:].size),
    }


@contextmanager
def quiet_ort_logs() -> Iterator[None]:
    """ORT's quantiser's per-node INFO lines and its shape-inference pre-processing advice
    silenced, the levels put back after. Rewrites on several threads run inside one of
    these (export/from_blocks.py): theirs then save and put back ERROR, never a level one
    of them set."""
    loggers = [logging.getLogger(), logging.getLogger(
        "onnxruntime.quantization.matmul_nbits_quantizer")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, levels, strict=True):
            lg.setLevel(lv)


def quantize_weights(src: Path, dst: Path, method: str = "int8",
                     training: dict[str, Any] | None = None,
                     flat: bool = False, level: int = ACCURACY_LEVEL,
                     halves: bool | None = None, source: GGUFFile | None = None,
                     kernel: str = "nbits", repack: bool = False) -> dict[str, Any]:
    """Write ``src`` with its MatMul weights quantised by ``method`` to ``dst``.

    ``training`` is the checkpoint's training record: ``gguf`` finds its source file there.
    ``flat``: the graph's activations are (tokens, features) matrices, as in the engine
    graphs (``gguf`` then writes each Q4_1 remainder as one Gemm). ``level``: MatMulNBits'
    accuracy level (4: int8 activations; 0: float); ``halves``: gguf's 8-bit blocks as
    two 4-bit products (default: at level 0; export/gguf/blocks.py); ``source``: gguf's
    file already opened and checked (export/gguf/source.py ``open_source``), for an export
    that rewrites several graphs; ``kernel``: gguf's kept blocks as MatMulNBits (``nbits``)
    or as the file's bytes under GgufMatMul (``ggml``; export/gguf/blocks.py), with
    ``repack`` in ggml's repack layout where it has one.
    """
    if method not in METHODS:
        raise ValueError(f"unsupported quantization {method!r}; choose one of {list(METHODS)}")
    with quiet_ort_logs():
        if method == "gguf":
            figures = _gguf_blocks(src, dst, source or open_source(training or {}), flat,
                                   level, halves, kernel, repack)
        elif method in NBITS:
            figures = _matmul_nbits(src, dst, *NBITS[method], level)
        else:
            from onnxruntime.quantization import QuantType, quantize_dynamic

            # 7-bit weights (reduce_range): ONNX Runtime's u8·s8 kernel on AVX2 / AVX-512
            # without VNNI sums two products in int16 (vpmaddubsw), which 255·127·2
            # overflows; 255·63·2 does not, so every x86 host computes the same products
            quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8,
                             op_types_to_quantize=["MatMul"], per_channel=True,
                             reduce_range=True)
            figures = {"method": "onnxruntime.quantization.quantize_dynamic",
                       "weight_type": "QInt8", "per_channel": True, "reduce_range": True,
                       "op_types": ["MatMul"],
                       "activation_scales": "per row",
                       "rows_requantised": _activations_per_row(dst)}
    from export.onnx.onnx_build import weight_bytes

    return {"quantization": method, **figures, "fp32_bytes": weight_bytes(src),
            "quantized_bytes": weight_bytes(dst)}


def _activations_per_row(path: Path) -> int:
    """``quantize_dynamic``'s graph at ``path`` with its activations quantised per row
    (export/quantize/dynamic_rows.py), rewritten through a temporary file; the inputs rewritten."""
    import onnx

    from export.quantize.dynamic_rows import per_row_activations

    model = onnx.load(str(path), load_external_data=False)  # weights stay where they are
    count = per_row_activations(model)
    tmp = path.with_name(f"{path.name}.rows.tmp")
    onnx.save(model, str(tmp))
    os.replace(tmp, path)
    return count


def _nbits_quantizer(model: Any, bits: int, symmetric: bool,
                    exclude: frozenset[str] = frozenset(), level: int = ACCURACY_LEVEL) -> Any:
    """``model`` (onnx.ModelProto) with every MatMul not in ``exclude`` quantised."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    config = DefaultWeightOnlyQuantConfig(block_size=BLOCK_SIZE, is_symmetric=symmetric,
                                          accuracy_level=level, bits=bits)
    quantizer = MatMulNBitsQuantizer(model, nodes_to_exclude=list(exclude),
                                     algo_config=config)
    quantizer.process()
    return quantizer.model.model


def _gguf_blocks(src: Path, dst: Path, source: GGUFFile,
                 flat: bool, level: int, halves: bool | None, kernel: str,
                 repack: bool = False) -> dict[str, Any]:
    """The source GGUF file's blocks where they map onto MatMulNBits; our int4/int8 for
    the weights of other types (``fallback``, by node)."""
    import onnx
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    from export.gguf.blocks import SideFile, rewrite_file

    # the new weights written as they are made, where the source graph's external data is
    # in the same directory (see _save)
    side = SideFile(_side_data(dst)) if src.parent.resolve() == dst.parent.resolve() else None
    try:
        model, figures = rewrite_file(src, source, level=level, flat=flat, halves=halves,
                                      side=side, kernel=kernel, repack=repack)
    finally:
        if side is not None:
            side.close()
    fallback = figures["fallback"]
    if fallback:  # ORT's quantiser reads the weights it rewrites from the proto
        wanted = {f["weight"] for f in fallback.values()}
        for tensor in model.graph.initializer:
            if tensor.name in wanted and uses_external_data(tensor):
                load_external_data_for_tensor(tensor, str(src.parent))
                tensor.data_location = onnx.TensorProto.DEFAULT
                del tensor.external_data[:]
    for bits, method in ((4, "int4"), (8, "int8")):
        names = {n for n, f in fallback.items() if f["bits"] == bits}
        if names:
            others = frozenset(n.name for n in model.graph.node if n.op_type == "MatMul"
                               and n.name not in names)
            model = _nbits_quantizer(model, *NBITS[method], exclude=others, level=level)
            for n in names:
                fallback[n]["as"] = method
    figures["quantized_matmuls"] = sum(n.op_type in ("MatMulNBits", "GgufMatMul", "GgufGather")
                                       for n in model.graph.node)
    figures["float_matmuls_left"] = sum(n.op_type == "MatMul" and n.input[1] in {
        t.name for t in model.graph.initializer} and not n.name.endswith(".gguf_mins")
        and ".gguf_block_sums" not in n.output[0] for n in model.graph.node)
    if figures["quantized_matmuls"] == 0:
        raise ValueError(f"{src.name}: no weight of the GGUF file to keep or quantise")
    _save(model, dst, src.parent, written=side is not None)
    return figures


def _side_data(graph: Path) -> Path:
    return graph.with_name(graph.name + SIDE_DATA)


def _save(model: Any, dst: Path, base: Path | None = None, written: bool = False) -> None:
    """Topologically sorted, its new weights in a side file (``dst`` + ".data": a graph
    of over 2 GB, a 3B model's blocks, cannot be one protobuf); export_artifact moves
    them into weights.bin afterwards and deletes the side files. Tensors left in
    ``base``'s external data keep pointing there when ``dst`` is in that directory, and
    are copied into the side file otherwise. ``written``: the side file holds the new
    weights already (export/gguf/blocks.py ``SideFile``); those still in memory go after
    them."""
    import onnx
    from onnxruntime.quantization.onnx_model import ONNXModel

    if base is not None and base.resolve() != dst.parent.resolve():
        onnx.load_external_data_for_model(model, str(base))
    if not written:
        _side_data(dst).unlink(missing_ok=True)  # onnx appends to it
    ONNXModel(model).save_model_to_file(str(dst), use_external_data_format=True)


def _matmul_nbits(src: Path, dst: Path, bits: int, symmetric: bool,
                  level: int) -> dict[str, Any]:
    import onnx

    out = _nbits_quantizer(onnx.load(str(src)), bits, symmetric, level=level)
    done = sum(n.op_type == "MatMulNBits" for n in out.graph.node)
    if done == 0:
        raise ValueError(f"{src.name}: no MatMul with a constant weight to quantise")
    _save(out, dst)
    return {"method": "onnxruntime MatMulNBitsQuantizer (MatMulNBits)", "bits": bits,
            "block_size": BLOCK_SIZE, "symmetric": symmetric, "accuracy_level": level,
            "quantized_matmuls": done,
            "float_matmuls_left": sum(n.op_type == "MatMul" for n in out.graph.node)}


def quantize_graph(gpt: GPT, src: Path, dst: Path, tokenizer: Any, training: dict[str, Any],
                   method: str, level: int, kernel: str, flat: bool = False,
                   decoder: Callable[[Path], Decoder] | None = None) -> dict[str, Any]:
    """Write the ``method`` version of the float32 graph ``src`` to ``dst``; return the
    figures. ``decoder`` (what runs either graph): the two compared on held-out text."""
    from export.gguf.blocks import repacks

    figures = quantize_weights(src, dst, method, training, flat=flat, level=level,
                               kernel=kernel, repack=repacks(kernel, level))
    if decoder is not None:
        figures.update(compare_decoders(gpt, lambda: decoder(src), lambda: decoder(dst),
                                        tokenizer, training, method))
    return figures
