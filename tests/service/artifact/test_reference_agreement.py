"""The int8 agreement metric (service/contract/reference.py) on a decoder whose choices are
known: a bigram table, so every expected figure is computed here from the table alone."""

from __future__ import annotations

import numpy as np

from service.contract.reference import agreement_with, greedy

VOCAB = 11


class Bigram:
    """Logits of the next token from the last one fed: ``table[last]``; the past is the
    tokens fed so far (unused but carried, as a real cache is)."""

    def __init__(self, table: np.ndarray) -> None:
        self.table = table  # (V, V)

    def empty_past(self, batch: int) -> list[np.ndarray]:
        return [np.zeros((batch, 0), np.int64)]

    def __call__(self, ids: np.ndarray, mask: np.ndarray, pos: np.ndarray,
                 past: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        return self.table[ids], [np.concatenate([past[0], ids], axis=1)]  # (B, T, V)


def walk(table: np.ndarray, last: int, steps: int, forced: list[int] | None = None
         ) -> list[int]:
    """The argmax chain from ``last``, fed ``forced`` instead where given."""
    out = []
    for step in range(steps):
        out.append(int(table[last].argmax()))
        last = forced[step] if forced is not None else out[-1]
    return out


def test_agreement_is_teacher_forced_and_free_running_per_prompt() -> None:
    rng = np.random.default_rng(0)
    reference, candidate = rng.standard_normal((2, VOCAB, VOCAB))
    candidate[:5] = reference[:5]  # agree after tokens 0-4, differ after the rest
    prompts = rng.integers(0, VOCAB, (6, 3))
    steps = 9
    expected = greedy(Bigram(reference), prompts, steps)  # type: ignore[arg-type]
    want = np.array([walk(reference, int(p[-1]), steps) for p in prompts])
    assert np.array_equal(expected, want)

    figures = agreement_with(Bigram(candidate), prompts, expected)  # type: ignore[arg-type]
    forced = np.array([walk(candidate, int(p[-1]), steps, list(e))
                       for p, e in zip(prompts, expected, strict=True)])
    free = np.array([walk(candidate, int(p[-1]), steps) for p in prompts])
    prefixes = [next((i for i in range(steps) if f[i] != e[i]), steps)
                for f, e in zip(free, expected, strict=True)]
    assert 0 < figures["token_agreement"] < 1  # the table was built to disagree somewhere
    assert figures["token_agreement"] == (forced == expected).mean()
    assert figures["free_running_mean_common_prefix"] == np.mean(prefixes)
    assert (figures["prompts"], figures["steps"], figures["positions"]) == (6, steps, 6 * steps)
