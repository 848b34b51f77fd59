"""Parity checks of an exported artifact against the PyTorch model it came from.

Run by the exporter before anything is written to the target directory; any violation
raises :class:`VerificationError` and the export fails. The figures go to manifest.json.

- prefill: random prompts through model.onnx with zero-length past tensors vs GPT.forward;
- decode: N steps through the KV cache vs PyTorch recomputing the whole sequence each step,
  feeding the reference's greedy token, so "argmax equal at every step" is exactly "greedy
  tokens identical" and the logits stay comparable at every step;
- ragged batch: left-padded prompts of different lengths, prefill and decode, each row vs
  that prompt alone in PyTorch;
- attention.onnx: weights vs GPT intermediates, rows sum to 1, nothing above the diagonal.

ORT is driven only through the names in service/contract/io_spec.py, as any client would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from model.gpt import GPT
from service.contract import io_spec as io
from service.contract.reference import OrtDecoder
from service.contract.sessions import create_session

FP32_LOGITS_TOL = 1e-4
FP16_LOGITS_TOL = 1e-2  # the cache is rounded to float16; compute stays float32
ATTENTION_TOL = 1e-5
DECODE_STEPS = 64


class VerificationError(ValueError):
    """The exported graph disagrees with PyTorch beyond the tolerance."""


def decoder_for(path: str | Path, gpt: GPT, kv_dtype: io.KvDtype) -> OrtDecoder:
    cfg = gpt.config
    return OrtDecoder.from_file(path, cfg.n_layers, cfg.n_heads, cfg.head_dim, kv_dtype)


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[np.ndarray, ...]:
    """ids, attention_mask, position_ids for a left-padded batch (int64)."""
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_id, np.int64)
    mask = np.zeros((len(prompts), width), np.int64)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = p
        mask[row, width - len(p):] = 1
    pos = np.clip(mask.cumsum(-1) - 1, 0, None).astype(np.int64)
    return ids, mask, pos


@torch.no_grad()
def torch_last_logits(gpt: GPT, seq: list[int]) -> np.ndarray:
    """Full recomputation without cache: logits at the last position, (V,)."""
    out = gpt(torch.tensor([seq], dtype=torch.long))
    return out.logits[0, -1].float().numpy()


def random_prompts(rng: np.random.Generator, vocab: int, lengths: list[int]) -> list[list[int]]:
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


@torch.no_grad()
def check_prefill(gpt: GPT, dec: OrtDecoder, rng: np.random.Generator,
                  batch: int = 4, length: int = 16) -> dict[str, Any]:
    length = min(length, gpt.config.max_seq_len)
    ids = np.asarray(random_prompts(rng, gpt.config.vocab_size, [length] * batch), np.int64)
    mask = np.ones_like(ids)
    pos = np.broadcast_to(np.arange(length, dtype=np.int64), ids.shape).copy()
    logits, present = dec(ids, mask, pos, dec.empty_past(batch))
    ref = gpt(torch.from_numpy(ids)).logits.numpy()  # (B, T, V)
    if present[0].shape != (batch, dec.n_heads, length, dec.head_dim):
        raise VerificationError(f"present shape {present[0].shape} after a zero-length past")
    return {"max_abs_diff": float(np.abs(logits - ref).max()), "prompts": batch,
            "prompt_length": length, "past_length": 0}


def check_decode(gpt: GPT, dec: OrtDecoder, rng: np.random.Generator, steps: int = DECODE_STEPS,
                 batch: int = 2, prompt_len: int = 8) -> dict[str, Any]:
    """Cached decode vs full recomputation, teacher-forced with PyTorch's greedy tokens."""
    steps = max(1, min(steps, gpt.config.max_seq_len - prompt_len))
    prompts = random_prompts(rng, gpt.config.vocab_size, [prompt_len] * batch)
    ids, mask, pos = left_pad(prompts)
    logits, past = dec(ids, mask, pos, dec.empty_past(batch))
    seqs = [list(p) for p in prompts]
    worst, mismatches = 0.0, 0
    for step in range(steps):
        for row in range(batch):
            ref = torch_last_logits(gpt, seqs[row])
            got = logits[row, -1].astype(np.float32)
            worst = max(worst, float(np.abs(got - ref).max()))
            mismatches += int(np.argmax(got) != np.argmax(ref))
            seqs[row].append(int(np.argmax(ref)))
        if step == steps - 1:
            break
        nxt = np.array([[s[-1]] for s in seqs], np.int64)  # (B, 1)
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
        pos = pos[:, -1:] + 1
        logits, past = dec(nxt, mask, pos, past)
    return {"max_abs_diff": worst, "steps": steps, "batch": batch, "prompt_length": prompt_len,
            "greedy_mismatches": mismatches, "greedy_tokens_identical": mismatches == 0}


def check_ragged(gpt: GPT, dec: OrtDecoder, rng: np.random.Generator,
                 lengths: tuple[int, ...] = (3, 11, 6), steps: int = 8) -> dict[str, Any]:
    """A left-padded batch must give, row by row, what each prompt gives alone."""
    prompts = random_prompts(rng, gpt.config.vocab_size, list(lengths))
    ids, mask, pos = left_pad(prompts)
    logits, past = dec(ids, mask, pos, dec.empty_past(len(prompts)))
    seqs = [list(p) for p in prompts]
    worst = 0.0
    with torch.no_grad():
        for row, p in enumerate(prompts):
            alone = gpt(torch.tensor([p])).logits[0].numpy()  # (T_row, V)
            worst = max(worst, float(np.abs(logits[row, -len(p):] - alone).max()))
    for step in range(steps):
        if step:
            nxt = np.array([[s[-1]] for s in seqs], np.int64)
            mask = np.concatenate([mask, np.ones((len(seqs), 1), np.int64)], axis=1)
            pos = pos[:, -1:] + 1
            logits, past = dec(nxt, mask, pos, past)
        for row, seq in enumerate(seqs):
            ref = torch_last_logits(gpt, seq)
            worst = max(worst, float(np.abs(logits[row, -1] - ref).max()))
            seq.append(int(np.argmax(ref)))
    return {"max_abs_diff": worst, "rows": len(prompts), "lengths": list(lengths),
            "decode_steps": steps}


@torch.no_grad()
def check_attention(gpt: GPT, path: str | Path, rng: np.random.Generator,
                    lengths: tuple[int, ...] = (12, 7)) -> dict[str, Any]:
    sess = create_session(path)
    n = gpt.config.n_layers
    ids, mask, pos = left_pad(random_prompts(rng, gpt.config.vocab_size, list(lengths)))
    outs = dict(zip(io.attention_output_names(n),
                    sess.run(io.attention_output_names(n), {
                        io.INPUT_IDS: ids, io.ATTENTION_MASK: mask, io.POSITION_IDS: pos}),
                    strict=True))
    ref = gpt(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
              position_ids=torch.from_numpy(pos), return_intermediates=True).intermediates
    assert ref is not None
    t = ids.shape[1]
    upper = np.triu(np.ones((t, t), bool), k=1)
    figures: dict[str, Any] = {"weights_max_abs_diff": 0.0, "qkv_scores_max_abs_diff": 0.0,
               "row_sum_max_error": 0.0, "upper_triangle_max": 0.0, "layers": n,
               "lengths": list(lengths)}
    for layer, inter in enumerate(ref):
        got = {k: outs[io.attention_output_name(layer, k)] for k in io.ATTENTION_KINDS}
        w = got["weights"]  # (B, nh, T, T)
        figures["weights_max_abs_diff"] = max(figures["weights_max_abs_diff"], float(
            np.abs(w - inter.weights.numpy()).max()))
        for kind in ("q", "k", "v", "scores"):
            figures["qkv_scores_max_abs_diff"] = max(figures["qkv_scores_max_abs_diff"], float(
                np.abs(got[kind] - getattr(inter, kind).numpy()).max()))
        scaled_ref = inter.scaled_scores.numpy()
        if not np.array_equal(np.isneginf(got["scaled_scores"]), np.isneginf(scaled_ref)):
            raise VerificationError(f"attention.{layer}.scaled_scores: masked positions differ")
        figures["row_sum_max_error"] = max(figures["row_sum_max_error"],
                                           float(np.abs(w.sum(-1) - 1.0).max()))
        figures["upper_triangle_max"] = max(figures["upper_triangle_max"],
                                            float(np.abs(w[..., upper]).max()))
    return figures


def verify_decoder(gpt: GPT, model_path: Path, kv_dtype: io.KvDtype = "float32",
                   seed: int = 0, decode_steps: int = DECODE_STEPS) -> dict[str, Any]:
    """model.onnx checks only (prefill, cached decode, ragged batch); raise on a violation."""
    gpt.eval()
    rng = np.random.default_rng(seed)
    dec = decoder_for(model_path, gpt, kv_dtype)
    tol = FP16_LOGITS_TOL if kv_dtype == "float16" else FP32_LOGITS_TOL
    figures: dict[str, Any] = {
        "prefill": check_prefill(gpt, dec, rng),
        "decode": check_decode(gpt, dec, rng, steps=decode_steps),
        "ragged_batch": check_ragged(gpt, dec, rng),
    }
    problems = [f"{name} logits differ by {figures[name]['max_abs_diff']:.3g} > {tol:g}"
                for name in ("prefill", "decode", "ragged_batch")
                if not figures[name]["max_abs_diff"] <= tol]
    if not figures["decode"]["greedy_tokens_identical"]:
        problems.append(f"greedy tokens differ at {figures['decode']['greedy_mismatches']} of "
                        f"{figures['decode']['steps']} steps")
    if problems:
        raise VerificationError(f"{model_path.name} verification failed: " + "; ".join(problems))
    return figures


def verify_attention(gpt: GPT, attention_path: Path, seed: int = 1) -> dict[str, Any]:
    """attention.onnx checks; raise on a violation."""
    att = check_attention(gpt, attention_path, np.random.default_rng(seed))
    problems = []
    if not att["weights_max_abs_diff"] <= ATTENTION_TOL:
        problems.append(f"attention weights differ by {att['weights_max_abs_diff']:.3g}")
    if not att["row_sum_max_error"] <= ATTENTION_TOL:
        problems.append(f"attention rows sum to 1 ± {att['row_sum_max_error']:.3g}")
    if att["upper_triangle_max"] != 0.0:
        problems.append(f"attention above the diagonal: {att['upper_triangle_max']:.3g}")
    if problems:
        raise VerificationError(f"{attention_path.name} verification failed: "
                                + "; ".join(problems))
    return att


def verify_artifact(gpt: GPT, model_path: Path, attention_path: Path,
                    kv_dtype: io.KvDtype = "float32", seed: int = 0,
                    decode_steps: int = DECODE_STEPS) -> dict[str, Any]:
    """Run every check; raise VerificationError on a violation, else return the figures."""
    tol = FP16_LOGITS_TOL if kv_dtype == "float16" else FP32_LOGITS_TOL
    figures: dict[str, Any] = {"tolerance": {"logits": tol, "attention_weights": ATTENTION_TOL}}
    figures.update(verify_decoder(gpt, model_path, kv_dtype, seed, decode_steps))
    figures["attention"] = verify_attention(gpt, attention_path)
    figures["passed"] = True
    return figures
