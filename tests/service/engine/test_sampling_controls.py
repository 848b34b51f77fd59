"""Sampling controls against independent references: numpy formulas written from each
control's definition (OpenAI's penalties, vLLM's min_p and min_tokens) and transformers'
own logits warpers (temperature, top-k, top-p, typical-p, min-p), run in torch."""

from __future__ import annotations

import numpy as np
import pytest

from service.engine.request import SamplingParams
from service.engine.sampling import RowSampler, choose_tokens

V = 32


def logits_row(seed: int = 0, scale: float = 2.0) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=V) * scale).astype(np.float32)  # (V,)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def test_presence_and_frequency_penalties_follow_openais_formula() -> None:
    # OpenAI: mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty, where c
    # counts the token in the generated text only (prompt tokens do not count).
    logits = logits_row(1)
    row = RowSampler(SamplingParams(presence_penalty=0.7, frequency_penalty=0.4), V,
                     prompt_ids=[5, 6, 7])
    generated = [3, 3, 3, 9, 11, 9]
    for t in generated:
        row.observe(t)
    counts = np.bincount(generated, minlength=V)
    expected = logits.astype(np.float64) - counts * 0.4 - (counts > 0) * 0.7
    np.testing.assert_allclose(row.processed_logits(logits), expected, rtol=1e-12)


def test_negative_presence_penalty_encourages_repetition() -> None:
    logits = np.zeros(V, dtype=np.float32)
    logits[0] = 1.0
    row = RowSampler(SamplingParams(presence_penalty=-2.0), V, prompt_ids=[])
    row.observe(4)
    tokens, _ = choose_tokens(logits[None, :], [row])
    assert tokens[0] == 4  # 0 + 2 > 1


def test_logit_bias_adds_to_the_logits_and_can_force_a_token() -> None:
    logits = logits_row(2)
    row = RowSampler(SamplingParams(logit_bias=((4, 3.5), (10, -100.0))), V, prompt_ids=[])
    expected = logits.astype(np.float64)
    expected[4] += 3.5
    expected[10] -= 100.0
    np.testing.assert_allclose(row.processed_logits(logits), expected, rtol=1e-12)
    forced = RowSampler(SamplingParams(do_sample=True, seed=1, logit_bias=((17, 100.0),)), V,
                        prompt_ids=[])
    assert {forced.choose(logits) for _ in range(50)} == {17}


def test_min_tokens_masks_the_stop_ids_until_enough_tokens_are_generated() -> None:
    logits = logits_row(3)
    stop = int(np.argmax(logits))
    row = RowSampler(SamplingParams(min_tokens=2, suppress_ids=(stop, 1)), V, prompt_ids=[])
    for step in range(3):
        x = row.processed_logits(logits)
        masked = step < 2
        assert np.isneginf(x[[stop, 1]]).all() == masked
        assert np.isfinite(np.delete(x, [stop, 1])).all()
        token = int(choose_tokens(logits[None, :], [row])[0][0])
        assert (token != stop) if masked else (token == stop)


class OnlyTokens:
    """A stand-in grammar: only the given tokens may come next; records what it saw."""

    def __init__(self, allowed: list[int]) -> None:
        self.mask = np.zeros(V, dtype=bool)
        self.mask[allowed] = True
        self.consumed: list[int] = []

    def allowed(self) -> np.ndarray:
        return self.mask

    def consume(self, token_id: int) -> None:
        self.consumed.append(token_id)


class Factory:
    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed
        self.made: list[OnlyTokens] = []

    def new(self) -> OnlyTokens:
        self.made.append(OnlyTokens(self.allowed))
        return self.made[-1]


def test_a_constraint_masks_the_row_and_sees_every_chosen_token() -> None:
    factory = Factory([2, 7, 30])
    rows = [RowSampler(SamplingParams(constraint=factory), V, []),
            RowSampler(SamplingParams(), V, []),  # a free row in the same batch
            RowSampler(SamplingParams(do_sample=True, seed=3, constraint=factory), V, [])]
    rng = np.random.default_rng(0)
    for _ in range(20):
        logits = rng.normal(size=(3, V)).astype(np.float32)  # (B, V)
        tokens, _ = choose_tokens(logits, rows)
        assert tokens[0] == [2, 7, 30][int(np.argmax(logits[0, [2, 7, 30]]))]
        assert tokens[1] == int(np.argmax(logits[1]))
        assert int(tokens[2]) in (2, 7, 30)
    assert [len(m.consumed) for m in factory.made] == [20, 20]


def test_min_tokens_yields_to_a_grammar_that_allows_only_the_end() -> None:
    row = RowSampler(SamplingParams(min_tokens=5, suppress_ids=(2,), constraint=Factory([2])),
                     V, [])
    assert int(choose_tokens(logits_row(4)[None, :], [row])[0][0]) == 2


def test_min_p_keeps_tokens_above_a_fraction_of_the_top_probability() -> None:
    logits = logits_row(5)
    params = SamplingParams(do_sample=True, seed=0, temperature=0.8, min_p=0.2)
    got = RowSampler(params, V, []).distribution(logits)
    p = softmax(logits.astype(np.float64) / 0.8)
    kept = p >= 0.2 * p.max()
    expected = np.where(kept, p, 0.0) / p[kept].sum()
    assert 1 < kept.sum() < V
    np.testing.assert_allclose(got, expected, atol=1e-12)


torch = pytest.importorskip("torch")
generation = pytest.importorskip("transformers.generation.logits_process")


def transformers_distribution(logits: np.ndarray, *warpers: object) -> np.ndarray:
    scores = torch.tensor(logits, dtype=torch.float64)[None, :]  # (1, V)
    ids = torch.zeros((1, 1), dtype=torch.long)
    for warper in warpers:
        scores = warper(ids, scores)  # type: ignore[operator]
    return torch.softmax(scores, dim=-1)[0].numpy()


@pytest.mark.parametrize("mass", [0.2, 0.5, 0.9, 0.99])
def test_typical_p_equals_transformers_typical_warper(mass: float) -> None:
    for seed in range(5):
        logits = logits_row(10 + seed)
        got = RowSampler(SamplingParams(do_sample=True, seed=0, typical_p=mass), V,
                         []).distribution(logits)
        expected = transformers_distribution(logits, generation.TypicalLogitsWarper(mass))
        np.testing.assert_allclose(got, expected, atol=1e-9)


def test_min_p_equals_transformers_min_p_warper() -> None:
    for seed in range(5):
        logits = logits_row(20 + seed)
        got = RowSampler(SamplingParams(do_sample=True, seed=0, min_p=0.1, temperature=1.5), V,
                         []).distribution(logits)
        expected = transformers_distribution(
            logits, generation.TemperatureLogitsWarper(1.5), generation.MinPLogitsWarper(0.1))
        np.testing.assert_allclose(got, expected, atol=1e-9)


def test_tgi_warper_chain_equals_transformers() -> None:
    """temperature → top-k → top-p → typical-p, TGI's order, as one distribution."""
    for seed in range(5):
        logits = logits_row(30 + seed)
        params = SamplingParams(do_sample=True, seed=0, temperature=0.7, top_k=20, top_p=0.9,
                                typical_p=0.8)
        got = RowSampler(params, V, []).distribution(logits)
        expected = transformers_distribution(
            logits, generation.TemperatureLogitsWarper(0.7), generation.TopKLogitsWarper(20),
            generation.TopPLogitsWarper(0.9), generation.TypicalLogitsWarper(0.8))
        np.testing.assert_allclose(got, expected, atol=1e-9)


def test_draws_follow_the_processed_distribution() -> None:
    logits = logits_row(40, scale=1.0)
    params = SamplingParams(do_sample=True, seed=123, temperature=1.2, min_p=0.05,
                            presence_penalty=0.5, frequency_penalty=0.3,
                            logit_bias=((0, 1.0),))
    row = RowSampler(params, V, [])
    row.observe(1)
    row.observe(1)
    expected = softmax(row.processed_logits(logits) / 1.2)
    expected = np.where(expected >= 0.05 * expected.max(), expected, 0.0)
    expected /= expected.sum()
    n = 20000
    # choose() alone does not observe, so the counts stay as they are between draws
    draws = np.bincount([row.choose(logits) for _ in range(n)], minlength=V) / n
    assert np.abs(draws - expected).max() < 0.02
