"""Next-token choice in NumPy, per request: greedy, temperature, top-k, top-p, repetition penalty.

Each sampling request owns a ``numpy.random.Generator`` seeded from its own seed and draws
exactly one uniform number per generated token, so its text depends only on its own
logits, never on what else shares the batch. Greedy rows without a penalty, the common
case, are chosen with one vectorised argmax over the batch.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import numpy as np

from service.engine.request import SamplingParams


class RowSampler:
    """The sampling state of one sequence: its parameters, generator and seen tokens."""

    def __init__(self, params: SamplingParams, vocab_size: int, prompt_ids: Sequence[int]) -> None:
        self.params = params
        self.seed: int | None = None
        self.rng: np.random.Generator | None = None
        if params.do_sample:
            self.seed = params.seed if params.seed is not None else secrets.randbits(63)
            self.rng = np.random.default_rng(self.seed)
        self.seen: np.ndarray | None = None
        if params.repetition_penalty != 1.0:
            self.seen = np.zeros(vocab_size, dtype=bool)  # (V,)
            self.seen[np.asarray(prompt_ids, dtype=np.int64)] = True

    def observe(self, token_id: int) -> None:
        if self.seen is not None:
            self.seen[token_id] = True

    def choose(self, logits: np.ndarray) -> int:
        """One token from a (V,) row of raw logits."""
        p = self.params
        x = logits.astype(np.float64)  # (V,) a copy: the batch's logits stay untouched
        if self.seen is not None:
            seen = x[self.seen]
            x[self.seen] = np.where(seen > 0, seen / p.repetition_penalty,
                                    seen * p.repetition_penalty)
        if self.rng is None:
            return int(np.argmax(x))
        x /= p.temperature
        if 0 < p.top_k < x.shape[0]:
            kth = np.partition(x, -p.top_k)[-p.top_k]
            x[x < kth] = -np.inf
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cumulative = np.cumsum(probs[order])
            keep = int(np.searchsorted(cumulative, p.top_p)) + 1  # smallest set reaching top_p
            kept = np.zeros_like(probs)
            kept[order[:keep]] = probs[order[:keep]]
            probs = kept / kept.sum()
        cdf = np.cumsum(probs)
        u = self.rng.random() * cdf[-1]
        return int(min(np.searchsorted(cdf, u, side="right"), probs.shape[0] - 1))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-probabilities of (B, V) logits, in float32."""
    shifted = logits - logits.max(axis=-1, keepdims=True)  # (B, V)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def choose_tokens(
    logits: np.ndarray, samplers: Sequence[RowSampler]
) -> tuple[np.ndarray, np.ndarray]:
    """Next token and its log-probability under the model for every row of (B, V) logits.

    The reported log-probability is the model's (before temperature, top-k, top-p), the
    quantity TGI's ``logprob`` and OpenAI's ``logprobs`` describe.
    """
    rows = np.arange(logits.shape[0])
    tokens = logits.argmax(axis=-1)  # (B,) greedy for every row first
    for i, sampler in enumerate(samplers):
        if not sampler.params.is_plain_greedy:
            tokens[i] = sampler.choose(logits[i])
    peak = logits.max(axis=-1)  # (B,)
    log_z = peak + np.log(np.exp(logits - peak[:, None]).sum(axis=-1))  # (B,)
    logprobs = logits[rows, tokens] - log_z  # (B,)
    for sampler, token in zip(samplers, tokens, strict=True):
        sampler.observe(int(token))
    return tokens.astype(np.int64), logprobs.astype(np.float64)


def top_logprobs(logits_row: np.ndarray, n: int) -> list[tuple[int, float]]:
    """The n most likely tokens of one (V,) row with their log-probabilities, best first."""
    lp = log_softmax(logits_row[None, :])[0]  # (V,)
    n = min(n, lp.shape[0])
    best = np.argpartition(-lp, n - 1)[:n]
    best = best[np.argsort(-lp[best], kind="stable")]
    return [(int(i), float(lp[i])) for i in best]
