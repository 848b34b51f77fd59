"""Dynamic int8 quantisation of model.onnx and the figures that judge it.

``onnxruntime.quantization.quantize_dynamic`` stores the MatMul weights as int8 (per
output channel) and quantises activations on the fly; embeddings, LayerNorms and the KV
cache stay float32, so the I/O contract is unchanged. Logits no longer match PyTorch to
1e-4, so int8 is judged differently, on held-out text:

- token agreement: the float32 graph decodes greedily for 64 steps; the int8 graph is fed
  the same tokens through its KV cache and we count the steps where its argmax agrees;
- the length of the common prefix when the int8 graph decodes freely;
- validation perplexity of both graphs on held-out windows, and its relative change.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

from export.verify import decoder_for
from model.gpt import GPT
from service.contract.reference import OrtDecoder, int8_agreement

AGREEMENT_TARGET = 0.95
STEPS = 64
PROMPTS = 8
PROMPT_TOKENS = 16
FALLBACK_TEXT = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
    "with a single step. To be, or not to be, that is the question. All that glitters is "
    "not gold. Knowledge is power, and time is money. Where there is a will there is a way. "
) * 8


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


def _run_all(dec: OrtDecoder, ids: np.ndarray) -> np.ndarray:
    b, t = ids.shape
    pos = np.broadcast_to(np.arange(t, dtype=np.int64), (b, t)).copy()
    logits, _ = dec(ids, np.ones_like(ids), pos, dec.empty_past(b))
    return logits  # (B, T, V)


def perplexity(dec: OrtDecoder, windows: np.ndarray) -> float:
    logits = _run_all(dec, windows[:, :-1]).astype(np.float64)  # (B, T, V)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, windows[:, 1:, None], axis=-1).mean()
    return float(math.exp(nll))


def int8_figures(gpt: GPT, fp32_path: Path, int8_path: Path, tokenizer: Any,
                 training: dict[str, Any]) -> dict[str, Any]:
    """Compare the int8 graph with the float32 one on held-out text."""
    cfg = gpt.config
    text, source = held_out_text(training)
    ids = np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, np.int64)
    steps = min(STEPS, cfg.max_seq_len - PROMPT_TOKENS)
    ref_dec, q_dec = decoder_for(fp32_path, gpt, "float32"), decoder_for(int8_path, gpt, "float32")

    stride = max(PROMPT_TOKENS, (len(ids) - PROMPT_TOKENS) // PROMPTS)
    prompts = np.stack([ids[i * stride:i * stride + PROMPT_TOKENS] for i in range(PROMPTS)])
    agreement = int8_agreement(ref_dec, q_dec, prompts, steps)

    window = min(cfg.max_seq_len, 128) + 1
    count = max(1, min(8, len(ids) // window))
    windows = np.stack([ids[i * window:(i + 1) * window] for i in range(count)])
    ppl_ref, ppl_q = perplexity(ref_dec, windows), perplexity(q_dec, windows)
    return {
        "held_out_source": source,
        "prompts": PROMPTS,
        "steps": steps,
        "token_agreement": round(agreement["token_agreement"], 4),
        "agreement_target": AGREEMENT_TARGET,
        "meets_target": agreement["token_agreement"] >= AGREEMENT_TARGET,
        "free_running_mean_common_prefix": round(agreement["free_running_mean_common_prefix"],
                                                 2),
        "perplexity_fp32": round(ppl_ref, 4),
        "perplexity_int8": round(ppl_q, 4),
        "perplexity_relative_change": round(ppl_q / ppl_ref - 1.0, 5),
        "perplexity_tokens": int(windows[:, 1:].size),
    }


def quantize_int8(gpt: GPT, model_path: Path, fp32_path: Path, tokenizer: Any,
                  training: dict[str, Any], measure: bool = True) -> dict[str, Any]:
    """Write the int8 version of ``fp32_path`` to ``model_path``; return the figures."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # quiet its advice to run shape-inference pre-processing
    try:
        quantize_dynamic(str(fp32_path), str(model_path), weight_type=QuantType.QInt8,
                         op_types_to_quantize=["MatMul"], per_channel=True)
    finally:
        root.setLevel(level)
    figures: dict[str, Any] = {"method": "onnxruntime.quantization.quantize_dynamic",
                               "weight_type": "QInt8", "per_channel": True,
                               "op_types": ["MatMul"],
                               "fp32_bytes": fp32_path.stat().st_size,
                               "int8_bytes": model_path.stat().st_size}
    if measure:
        figures.update(int8_figures(gpt, fp32_path, model_path, tokenizer, training))
    return figures


def int8_check(gpt: GPT, fp32_reference: Path, tokenizer: Any,
               training: dict[str, Any]) -> Any:
    """A check for optimize_decoder: the optimised int8 graph must still meet the target."""

    def check(path: Path) -> dict[str, Any]:
        figures = int8_figures(gpt, fp32_reference, path, tokenizer, training)
        if not figures["meets_target"]:
            raise ValueError(f"optimised int8 graph agreement {figures['token_agreement']}")
        return {k: figures[k] for k in ("token_agreement", "perplexity_int8")}

    return check
