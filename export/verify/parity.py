"""Parity checks of an exported artifact against the PyTorch model it came from.

Run by the exporter before anything is written to the target directory; any violation
raises :class:`VerificationError` and the export fails. The figures go to manifest.json.

- prefill: random prompts through model.onnx with zero-length past tensors vs GPT.forward;
- decode: N steps through the KV cache vs PyTorch recomputing the whole sequence without a
  cache, feeding PyTorch's greedy tokens, so "argmax equal at every step" is "greedy tokens
  identical" and the logits stay comparable at every step;
- ragged batch: left-padded prompts of different lengths, prefill and decode, each row vs
  that prompt alone in PyTorch;
- attention.onnx: weights vs GPT intermediates, rows sum to 1, nothing above the diagonal.

ORT is driven only through the names in service/contract/io_spec.py, as any client would.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from export.memory import release
from model.gpt import GPT
from model.sample import generate
from service.contract import io_spec as io
from service.contract.pages import release_file_pages
from service.contract.reference import OrtDecoder
from service.contract.sessions import create_session

FP32_LOGITS_TOL = 1e-4  # absolute floor: what small models are held to
FP16_LOGITS_TOL = 1e-2  # absolute floor of a float16 artifact's bound
ATTENTION_FLOOR = 1e-5  # absolute floor of the attention-weights bound
ROW_SUM_TOL = 1e-5  # a softmax row's sum: T terms in [0, 1], whatever the scores
UNIT_ROUNDOFF = 2.0 ** -24  # float32
HALF_UNIT_ROUNDOFF = 2.0 ** -11  # float16


def logits_tolerance(cfg: Any, scale: float, kv_dtype: io.KvDtype = "float32",
                     half: bool = False) -> float:
    """How far two correct float32 implementations of ``cfg`` may differ in the logits.

    ONNX Runtime and PyTorch sum every dot product in a different order (blocked
    kernels, fused ops). Each K-term dot product then rounds differently by about
    √K·u of its magnitude (u = 2⁻²⁴; rounding errors add like a random walk), and each
    of the L layers adds its own such error to the residual stream that the next layers
    carry on, so the difference grows about linearly with depth and in proportion to the
    logits' own size. Hence an absolute floor plus L·√K·u·max|logit|, with K the longest
    dot product (d_ff or d). A fixed 1e-4 fits tiny random models (logits near 1) but
    not a real 30-layer model, whose honest rounding reached 1.5e-4 at logits of ~20
    (this bound: ~2e-3); a real bug (a wrong mask, a dropped bias, a swapped head) moves
    logits by whole units. Greedy agreement is checked beside it.

    ``kv_dtype="float16"`` rounds each layer's keys and values to float16 once, by up to
    u' = 2⁻¹¹ of their size, an error the layers after carry on as they do their own:
    L·u'·max|logit| more (model.onnx of a float16 artifact). ``half``: a graph that
    computes in float16 too (a float16 artifact's engine graphs, export/onnx/float16.py). Its
    matrix products
    still accumulate in float32 (MLAS, cuBLAS) but round each output once to float16;
    the norms are float32. Each of a layer's two
    sublayers adds one such rounded output to the residual stream, and the stream itself
    is rounded after each add, so L layers leave about 2·L·u' of the stream's size, which
    the head carries into the logits in proportion to their own: an absolute floor plus
    2·L·u'·max|logit| (SmolLM2-135M: 0.37 at logits of 25, where float16 measured 0.14 at
    a prompt's last position). A wrong mask or a swapped head still moves logits by
    units, and greedy agreement wherever PyTorch's margin exceeds twice the bound is
    checked beside it.
    """
    depth_error = cfg.n_layers * (max(cfg.d_model, cfg.d_ff) ** 0.5) * UNIT_ROUNDOFF
    if half:
        depth_error += 2 * cfg.n_layers * HALF_UNIT_ROUNDOFF
    elif kv_dtype == "float16":
        depth_error += cfg.n_layers * HALF_UNIT_ROUNDOFF
    floor = FP16_LOGITS_TOL if kv_dtype == "float16" or half else FP32_LOGITS_TOL
    return float(floor + depth_error * scale)


def attention_tolerance(cfg: Any, qk_scale: float) -> float:
    """How far two correct float32 implementations' attention weights may differ.

    The weights are softmax outputs, in [0, 1]; softmax moves them by p_j·(δs_j − Σ p_k·δs_k),
    at most half the largest error δs of the scaled scores s = q·k/√hs. A score is a dot
    product of head_dim terms, so it rounds by about √hs·u of Σ|q_i·k_i| ≤ ‖q‖·‖k‖, and it
    inherits q's and k's own errors: the residual stream feeding them carries, as the
    logits do (:func:`logits_tolerance`), about L·√K·u of its size after L layers of K-term
    products, each of q and k contributing ‖δq‖·‖k‖/√hs. With ``qk_scale`` the largest
    ‖q‖·‖k‖/√hs of any head (a bound on every |s|), the bound is an absolute floor plus
    (L·√K + √hs/2)·u·qk_scale. A fixed 1e-5 fit tiny models but not a random Llama of
    hidden 256, heads of 64, whose honest rounding reached 1.53e-5; a real bug (a wrong
    mask, a swapped head, a missing 1/√hs) moves weights by tenths, far above it.
    """
    terms = cfg.n_layers * max(cfg.d_model, cfg.d_ff) ** 0.5 + cfg.head_dim ** 0.5 / 2
    return float(ATTENTION_FLOOR + terms * UNIT_ROUNDOFF * qk_scale)


def logit_scale(*arrays: np.ndarray) -> float:
    return float(max(np.abs(a).max() for a in arrays))


def top2_margin(reference: np.ndarray) -> float:
    """How far PyTorch's greedy choice leads its runner-up, (V,) logits."""
    top2 = np.partition(reference, -2)[-2:]
    return float(top2[1] - top2[0])


def clear_mismatches(margins: list[float], tolerance: float) -> list[float]:
    """The greedy disagreements a correct graph must not have: those where PyTorch's
    margin exceeds twice the rounding tolerance (closer calls are near-ties)."""
    return [m for m in margins if m > 2 * tolerance]


@dataclass
class DecodeParity:
    """A teacher-forced decode's figures so far: the largest logit difference from PyTorch,
    and PyTorch's top-2 margin at every greedy disagreement (judged by
    :func:`clear_mismatches` once the tolerance is known)."""

    worst: float = 0.0
    margins: list[float] = field(default_factory=list)

    def add(self, got: np.ndarray, ref: np.ndarray) -> None:
        """One step's logits (B, V) against PyTorch's (B, V)."""
        self.worst = max(self.worst, float(np.abs(got - ref).max()))
        self.margins += [top2_margin(ref[row])
                         for row in np.flatnonzero(got.argmax(-1) != ref.argmax(-1))]


DECODE_STEPS = 64
DECODE_LENGTHS = (8, 5)  # different, so that padding is exercised
PREFILL_BATCH, PREFILL_LENGTH = 4, 16
RAGGED_LENGTHS, RAGGED_STEPS = (3, 11, 6), 8
ATTENTION_SEED, ATTENTION_LENGTHS = 1, (12, 7)
CHECKS_ALONE = 50_000_000  # parameters below which checks run on one thread
PAGES_WORTH_DROPPING = 256 << 20  # bytes of weights beside a check's graph (check_session)


class VerificationError(ValueError):
    """The exported graph disagrees with PyTorch beyond the tolerance."""


def check_session(path: str | Path, threads: int = 1) -> Any:
    """A check's ONNX Runtime session, without the weight pages its packing read: ONNX
    Runtime keeps its mapping of the graph's weights (weights.bin, a rewrite's side file)
    with every page it read beside the packed copy; those are dropped (a read faults one
    back in). At 3B the checks held 5.3 GB with them."""
    session = create_session(path, threads=threads)
    directory = Path(path).parent
    # a walk of /proc/self/smaps costs ~13 ms: not worth it for a small model's few pages
    if sum(f.stat().st_size for f in directory.iterdir() if f.is_file()) >= PAGES_WORTH_DROPPING:
        release_file_pages(directory)
    return session


def decoder_for(path: str | Path, gpt: GPT, kv_dtype: io.KvDtype, threads: int = 1
                ) -> OrtDecoder:
    cfg = gpt.config
    return OrtDecoder(check_session(path, threads), cfg.n_layers, cfg.kv_heads, cfg.head_dim,
                      kv_dtype)


def check_threads(gpt: GPT) -> int:
    """Threads for a check's sessions: one for a model under ``CHECKS_ALONE`` parameters
    (its checks take seconds, and exact figures are easiest to compare from run to run),
    every core this process may use for a larger one, whose checks are most of an
    export's time (a 1B model's, minutes). The bounds hold whatever the count."""
    if sum(p.numel() for p in gpt.parameters()) < CHECKS_ALONE:
        return 1
    if hasattr(os, "sched_getaffinity"):  # Linux: the cores this process may run on
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def left_pad(prompts: list[list[int]]) -> tuple[np.ndarray, ...]:
    """ids, attention_mask, position_ids for a batch left-padded with 0 (int64)."""
    width = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), width), np.int64)
    mask = np.zeros((len(prompts), width), np.int64)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = p
        mask[row, width - len(p):] = 1
    pos = np.clip(mask.cumsum(-1) - 1, 0, None).astype(np.int64)
    return ids, mask, pos


@dataclass(frozen=True)
class Continuations:
    """PyTorch's greedy continuations of a batch of prompts (:meth:`TorchReference.greedy`),
    read step by step as a teacher-forced decode feeds them."""

    tokens: tuple[list[int], ...]  # each prompt and its greedy tokens
    logits: tuple[np.ndarray, ...]  # each (len − 1, V): row i follows tokens[: i + 1]
    lengths: list[int]  # the prompts'

    def expected(self, step: int) -> np.ndarray:
        """(B, V): the next-token logits after each prompt and ``step`` of its tokens."""
        return np.stack([r[k - 1 + step] for r, k in zip(self.logits, self.lengths,
                                                          strict=True)])

    def fed(self, step: int) -> np.ndarray:
        """(B,) int64: each row's greedy token number ``step`` (from 0), fed after it."""
        return np.array([s[k + step] for s, k in zip(self.tokens, self.lengths, strict=True)],
                        np.int64)


class TorchReference:
    """PyTorch's reference for the decode checks, each sequence computed once.

    ``greedy(prompt, steps)`` continues a prompt greedily with PyTorch's KV cache (cheap:
    one token per forward), then recomputes the whole result in ONE forward without any
    cache, whose logits at every position are the reference: causal attention makes them
    exactly what recomputing each prefix separately would give, at 1/steps of the cost
    (at GPT-2 size, 124 M parameters, the per-prefix forwards were most of an export's
    time). The checks of model.onnx and of its optimised graph feed the very same
    sequences, so they share one TorchReference.
    """

    def __init__(self, gpt: GPT) -> None:
        self.gpt = gpt
        self._greedy: dict[tuple[tuple[int, ...], int], tuple[list[int], np.ndarray]] = {}
        self._logits: dict[bytes, np.ndarray] = {}
        self._intermediates: dict[bytes, list[Any]] = {}

    def prepare(self, prompts: CheckPrompts) -> TorchReference:
        """Compute now everything the checks fed ``prompts`` compare against, so that
        PyTorch's weights can go before any ONNX Runtime session is made (a float32 session
        holds a second copy of every weight); returns self."""
        self.logits(prompts.prefill)
        for prompt, steps in prompts.continued(self.gpt.config):
            self.greedy(prompt, steps)
        self.intermediates(prompts.attention)
        return self

    @staticmethod
    def _logits_key(ids: np.ndarray) -> bytes:
        return repr(ids.shape).encode() + ids.astype(np.int64).tobytes()

    @torch.no_grad()
    def logits(self, ids: np.ndarray) -> np.ndarray:
        """GPT.forward's logits (B, T, V) for unpadded prompts ``ids`` (B, T)."""
        key = self._logits_key(ids)
        if key not in self._logits:
            self._logits[key] = self.gpt(torch.from_numpy(ids)).logits.numpy()
        return self._logits[key]

    @torch.no_grad()
    def intermediates(self, prompts: list[list[int]]) -> list[Any]:
        """GPT.forward's attention intermediates, layer by layer, for ``prompts`` left-padded
        (:func:`left_pad`)."""
        key = repr(prompts).encode()
        if key not in self._intermediates:
            ids, mask, pos = left_pad(prompts)
            out = self.gpt(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                           position_ids=torch.from_numpy(pos), return_intermediates=True)
            assert out.intermediates is not None
            self._intermediates[key] = out.intermediates
        return self._intermediates[key]

    @torch.no_grad()
    def greedy(self, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
        """(prompt + ``steps`` greedy tokens, full-recompute logits (len − 1, V) of every
        position but the last): row i holds the next-token logits after tokens[: i + 1]."""
        key = (tuple(prompt), steps)
        if key not in self._greedy:  # model/sample.py's decode loop, greedy
            tokens = generate(self.gpt, torch.tensor([prompt]), steps,
                              greedy=True).sequences[0].tolist()
            full = self.gpt(torch.tensor([tokens[:-1]])).logits[0]  # (len - 1, V)
            self._greedy[key] = (tokens, full.float().numpy())
        return self._greedy[key]

    def continuations(self, prompts: list[list[int]], steps: int) -> Continuations:
        tokens, logits = zip(*(self.greedy(p, steps) for p in prompts), strict=True)
        return Continuations(tokens, logits, [len(p) for p in prompts])


def random_prompts(rng: np.random.Generator, vocab: int, lengths: list[int]) -> list[list[int]]:
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


@dataclass(frozen=True)
class CheckPrompts:
    """What the checks feed, drawn from their seeds before any check runs, so that PyTorch
    can answer for all of them first (:meth:`TorchReference.prepare`)."""

    prefill: np.ndarray  # (B, T) int64, unpadded
    decode: list[list[int]]
    ragged: list[list[int]]
    attention: list[list[int]]

    def continued(self, cfg: Any) -> list[tuple[list[int], int]]:
        """Each decode and ragged prompt with the greedy steps its check continues it by."""
        steps = steps_within_context(cfg, self.decode, DECODE_STEPS)
        return [(p, steps) for p in self.decode] + [(p, RAGGED_STEPS) for p in self.ragged]


def check_prompts(cfg: Any) -> CheckPrompts:
    """The prompts of :func:`verify_decoder` (prefill, then decode, then ragged, from one
    generator of seed 0) and :func:`verify_attention` (``ATTENTION_SEED``'s)."""
    rng = np.random.default_rng(0)
    length = min(PREFILL_LENGTH, cfg.max_seq_len)
    prefill = np.asarray(random_prompts(rng, cfg.vocab_size, [length] * PREFILL_BATCH),
                         np.int64)
    decode = random_prompts(rng, cfg.vocab_size, list(DECODE_LENGTHS))
    ragged = random_prompts(rng, cfg.vocab_size, list(RAGGED_LENGTHS))
    attention = random_prompts(np.random.default_rng(ATTENTION_SEED), cfg.vocab_size,
                               list(ATTENTION_LENGTHS))
    return CheckPrompts(prefill, decode, ragged, attention)


def steps_within_context(cfg: Any, prompts: list[list[int]], steps: int) -> int:
    """``steps`` decode steps after ``prompts``, as many as the context leaves room for."""
    return max(1, min(steps, cfg.max_seq_len - max(len(p) for p in prompts)))


def check_prefill(gpt: GPT, dec: OrtDecoder, ids: np.ndarray,
                  reference: TorchReference | None = None) -> dict[str, Any]:
    """Unpadded prompts ``ids`` (B, T) with zero-length past tensors vs GPT.forward."""
    reference = reference or TorchReference(gpt)
    batch, length = ids.shape
    mask = np.ones_like(ids)
    pos = np.broadcast_to(np.arange(length, dtype=np.int64), ids.shape).copy()
    logits, present = dec(ids, mask, pos, dec.empty_past(batch))
    ref = reference.logits(ids)  # (B, T, V)
    if present[0].shape != (batch, dec.kv_heads, length, dec.head_dim):
        raise VerificationError(f"present shape {present[0].shape} after a zero-length past")
    return {"max_abs_diff": float(np.abs(logits - ref).max()), "prompts": batch,
            "prompt_length": length, "past_length": 0, "scale": logit_scale(ref)}


def check_decode(gpt: GPT, dec: OrtDecoder, prompts: list[list[int]],
                 reference: TorchReference | None = None) -> dict[str, Any]:
    """Cached decode vs full recomputation, teacher-forced with PyTorch's greedy tokens
    (left-padded rows of different lengths)."""
    steps = steps_within_context(gpt.config, prompts, DECODE_STEPS)
    forced = (reference or TorchReference(gpt)).continuations(prompts, steps)
    batch = len(prompts)
    ids, mask, pos = left_pad(prompts)
    logits, past = dec(ids, mask, pos, dec.empty_past(batch))
    parity = DecodeParity()  # its margins judged in verify_decoder: near-ties or not
    for step in range(steps):
        parity.add(logits[:, -1].astype(np.float32), forced.expected(step))
        if step == steps - 1:
            break
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
        pos = pos[:, -1:] + 1
        logits, past = dec(forced.fed(step)[:, None], mask, pos, past)  # (B, 1) fed
    margins = parity.margins
    return {"max_abs_diff": parity.worst, "steps": steps, "batch": batch,
            "prompt_lengths": forced.lengths, "prompts": prompts,
            "greedy_mismatches": len(margins), "greedy_tokens_identical": not margins,
            "mismatch_margins": margins, "scale": logit_scale(*forced.logits)}


def check_ragged(gpt: GPT, dec: OrtDecoder, prompts: list[list[int]],
                 reference: TorchReference | None = None) -> dict[str, Any]:
    """A left-padded batch must give, row by row, what each prompt gives alone."""
    forced = (reference or TorchReference(gpt)).continuations(prompts, RAGGED_STEPS)
    ids, mask, pos = left_pad(prompts)
    logits, past = dec(ids, mask, pos, dec.empty_past(len(prompts)))
    worst = 0.0
    for row, (k, ref) in enumerate(zip(forced.lengths, forced.logits, strict=True)):
        worst = max(worst, float(np.abs(logits[row, -k:] - ref[:k]).max()))  # as if alone
    for step in range(1, RAGGED_STEPS):
        mask = np.concatenate([mask, np.ones((len(prompts), 1), np.int64)], axis=1)
        pos = pos[:, -1:] + 1
        logits, past = dec(forced.fed(step - 1)[:, None], mask, pos, past)  # (B, 1) fed
        worst = max(worst, float(np.abs(logits[:, -1] - forced.expected(step)).max()))
    return {"max_abs_diff": worst, "rows": len(prompts), "lengths": forced.lengths,
            "decode_steps": RAGGED_STEPS, "scale": logit_scale(*forced.logits)}


@torch.no_grad()
def check_attention(gpt: GPT, path: str | Path, prompts: list[list[int]],
                    reference: TorchReference | None = None, threads: int = 1
                    ) -> dict[str, Any]:
    """attention.onnx's outputs for ``prompts``, left-padded, vs GPT's intermediates."""
    reference = reference or TorchReference(gpt)
    sess = check_session(path, threads)
    n = gpt.config.n_layers
    ids, mask, pos = left_pad(prompts)
    outs = dict(zip(io.attention_output_names(n),
                    sess.run(io.attention_output_names(n), {
                        io.INPUT_IDS: ids, io.ATTENTION_MASK: mask, io.POSITION_IDS: pos}),
                    strict=True))
    del sess
    ref = reference.intermediates(prompts)
    t = ids.shape[1]
    upper = np.triu(np.ones((t, t), bool), k=1)
    figures: dict[str, Any] = {"weights_max_abs_diff": 0.0, "qkv_scores_max_abs_diff": 0.0,
               "row_sum_max_error": 0.0, "upper_triangle_max": 0.0, "qk_scale": 0.0,
               "layers": n, "lengths": [len(p) for p in prompts]}
    for layer, inter in enumerate(ref):
        got = {k: outs[io.attention_output_name(layer, k)] for k in io.ATTENTION_KINDS}
        q_norm = inter.q.norm(dim=-1).amax(-1)  # (B, nh): each head's longest query
        k_norm = inter.k.norm(dim=-1).amax(-1)  # (B, nh): and key (GQA: its group's)
        figures["qk_scale"] = max(figures["qk_scale"], float(
            (q_norm * k_norm).max()) / gpt.config.head_dim ** 0.5)
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
                   reference: TorchReference | None = None, threads: int = 1
                   ) -> dict[str, Any]:
    """model.onnx checks only (prefill, cached decode, ragged batch); raise on a violation.

    Pass the same ``reference`` to re-verify another graph of the same model cheaply.
    """
    gpt.eval()
    prompts = check_prompts(gpt.config)
    dec = decoder_for(model_path, gpt, kv_dtype, threads)
    reference = reference or TorchReference(gpt)
    figures: dict[str, Any] = {
        "prefill": check_prefill(gpt, dec, prompts.prefill, reference),
        "decode": check_decode(gpt, dec, prompts.decode, reference),
        "ragged_batch": check_ragged(gpt, dec, prompts.ragged, reference),
    }
    del dec
    checks = ("prefill", "decode", "ragged_batch")
    tol = logits_tolerance(gpt.config, max(figures[n]["scale"] for n in checks), kv_dtype)
    figures["tolerance"] = tol
    problems = [f"{name} logits differ by {figures[name]['max_abs_diff']:.3g} > {tol:.3g}"
                for name in checks if not figures[name]["max_abs_diff"] <= tol]
    decode = figures["decode"]
    decided = clear_mismatches(decode["mismatch_margins"], tol)
    decode["near_ties"] = len(decode["mismatch_margins"]) - len(decided)
    if decided:
        problems.append(f"greedy tokens differ at {len(decided)} of {decode['steps']} steps "
                        f"where PyTorch's choice was clear (margins {decided[:3]})")
    if problems:
        raise VerificationError(f"{model_path.name} verification failed: " + "; ".join(problems))
    return figures


def verify_attention(gpt: GPT, attention_path: Path, reference: TorchReference | None = None,
                     threads: int = 1) -> dict[str, Any]:
    """attention.onnx checks; raise on a violation."""
    prompts = check_prompts(gpt.config).attention
    att = check_attention(gpt, attention_path, prompts, reference, threads)
    tol = att["tolerance"] = attention_tolerance(gpt.config, att["qk_scale"])
    problems = []
    if not att["weights_max_abs_diff"] <= tol:
        problems.append(f"attention weights differ by {att['weights_max_abs_diff']:.3g} > "
                        f"{tol:.3g}")
    if not att["row_sum_max_error"] <= ROW_SUM_TOL:
        problems.append(f"attention rows sum to 1 ± {att['row_sum_max_error']:.3g}")
    if att["upper_triangle_max"] != 0.0:
        problems.append(f"attention above the diagonal: {att['upper_triangle_max']:.3g}")
    if problems:
        raise VerificationError(f"{attention_path.name} verification failed: "
                                + "; ".join(problems))
    return att


def verify_artifact(gpt: GPT, model_path: Path, attention_path: Path,
                    kv_dtype: io.KvDtype = "float32",
                    reference: TorchReference | None = None, threads: int = 1
                    ) -> dict[str, Any]:
    """Run every check; raise VerificationError on a violation, else return the figures.

    ``reference``: PyTorch's side, shared with later checks; prepared from
    ``check_prompts(gpt.config)``, it needs PyTorch's weights no more."""
    figures = verify_decoder(gpt, model_path, kv_dtype, reference, threads)
    release()  # the decoder's session, before attention.onnx's (at 3B, 0.6 GB of the peak)
    figures["attention"] = verify_attention(gpt, attention_path, reference=reference,
                                            threads=threads)
    figures["tolerance"] = {"logits": figures["tolerance"],
                            "attention_weights": figures["attention"]["tolerance"]}
    figures["passed"] = True
    return figures


def described(figures: dict[str, Any], how: str = "") -> str:
    """:func:`verify_artifact`'s figures in a line."""
    return (f"verified{how}: prefill {figures['prefill']['max_abs_diff']:.2e}, decode "
            f"{figures['decode']['max_abs_diff']:.2e} over {figures['decode']['steps']} steps "
            f"(tolerance {figures['tolerance']['logits']:.2e}); attention.onnx "
            f"{figures['attention']['weights_max_abs_diff']:.2e}")
