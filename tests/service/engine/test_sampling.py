"""Next-token choice: greedy, temperature, top-k, top-p, repetition penalty, seeds."""

from __future__ import annotations

import numpy as np
import pytest

from service.engine.request import SamplingParams
from service.engine.sampling import RowSampler, choose_tokens, log_softmax, top_logprobs

V = 16


def logits_batch(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(rows, V)).astype(np.float32)  # (B, V)


def sampler(**kw: object) -> RowSampler:
    return RowSampler(SamplingParams(**kw), V, prompt_ids=[3, 4])  # type: ignore[arg-type]


def test_greedy_rows_take_the_argmax_and_report_model_logprobs() -> None:
    logits = logits_batch(3)
    tokens, logprobs = choose_tokens(logits, [sampler() for _ in range(3)])
    assert tokens.tolist() == logits.argmax(axis=1).tolist()
    expected = [float(np.log(np.exp(r).max() / np.exp(r).sum())) for r in logits.astype(float)]
    np.testing.assert_allclose(logprobs, expected, rtol=1e-5)


def test_only_the_rows_that_report_logprobs_pay_for_them() -> None:
    """Sampled rows too: the logprob is the model's, of the token drawn, against numpy."""
    logits = logits_batch(4, seed=3)
    rows = [sampler(), sampler(do_sample=True, seed=5, temperature=0.8), sampler(), sampler()]
    tokens, logprobs = choose_tokens(logits, rows, [True, True, False, True])
    lp = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(
        axis=1, keepdims=True))  # (4, V) log-softmax by hand
    expected = [lp[i, t] for i, t in enumerate(tokens)]
    np.testing.assert_allclose(logprobs[[0, 1, 3]], [expected[i] for i in (0, 1, 3)],
                               rtol=1e-5)
    assert np.isnan(logprobs[2])
    assert tokens[[0, 2, 3]].tolist() == logits[[0, 2, 3]].argmax(axis=1).tolist()


def test_top_k_one_and_tiny_top_p_are_greedy_even_when_sampling() -> None:
    logits = logits_batch(4, seed=1)
    for params in ({"top_k": 1}, {"top_p": 1e-6}):
        rows = [sampler(do_sample=True, seed=s, temperature=5.0, **params) for s in range(4)]
        tokens, _ = choose_tokens(logits, rows)
        assert tokens.tolist() == logits.argmax(axis=1).tolist(), params


def test_a_seeded_row_draws_the_same_tokens_whatever_shares_its_batch() -> None:
    rng = np.random.default_rng(7)
    steps = [rng.normal(size=(3, V)).astype(np.float32) for _ in range(20)]
    alone = sampler(do_sample=True, seed=42, temperature=1.3)
    crowd = [sampler(), sampler(do_sample=True, seed=42, temperature=1.3),
             sampler(do_sample=True, seed=9, top_k=4)]
    got_alone = [int(choose_tokens(s[1:2], [alone])[0][0]) for s in steps]
    got_crowd = [int(choose_tokens(s, crowd)[0][1]) for s in steps]
    assert got_alone == got_crowd
    assert len(set(got_alone)) > 3  # it really sampled


def test_unseeded_sampling_picks_a_seed_and_reports_it() -> None:
    row = sampler(do_sample=True)
    assert row.seed is not None
    assert sampler().seed is None  # greedy has no seed


def test_sampling_frequencies_follow_the_tempered_softmax() -> None:
    logits = np.array([2.0, 1.0, 0.0, -1.0], dtype=np.float32)
    row = RowSampler(SamplingParams(do_sample=True, seed=0, temperature=0.5), 4, [])
    draws = np.bincount([row.choose(logits) for _ in range(4000)], minlength=4) / 4000
    expected = np.exp(logits / 0.5) / np.exp(logits / 0.5).sum()
    np.testing.assert_allclose(draws, expected, atol=0.03)


def test_top_k_and_top_p_never_pick_outside_their_set() -> None:
    logits = np.array([3.0, 2.9, 0.0, -1.0, -2.0], dtype=np.float32)
    k2 = RowSampler(SamplingParams(do_sample=True, seed=1, top_k=2, temperature=3.0), 5, [])
    assert {k2.choose(logits) for _ in range(300)} == {0, 1}
    p = RowSampler(SamplingParams(do_sample=True, seed=1, top_p=0.8, temperature=1.0), 5, [])
    # softmax ≈ [0.50, 0.45, 0.03, ...]: the smallest set reaching 0.8 is {0, 1}.
    assert {p.choose(logits) for _ in range(300)} == {0, 1}


def test_repetition_penalty_discourages_seen_tokens() -> None:
    logits = np.zeros((1, V), dtype=np.float32)
    logits[0, 3], logits[0, 5] = 2.0, 1.5  # token 3 is in the prompt
    plain, _ = choose_tokens(logits, [sampler()])
    penalised, _ = choose_tokens(logits, [sampler(repetition_penalty=2.0)])
    assert (int(plain[0]), int(penalised[0])) == (3, 5)  # 2.0 / 2 = 1.0 < 1.5


def test_repetition_penalty_remembers_generated_tokens() -> None:
    logits = np.zeros((1, V), dtype=np.float32)
    logits[0, 7], logits[0, 8] = 1.0, 0.9
    row = sampler(repetition_penalty=1.5)
    first, _ = choose_tokens(logits, [row])
    second, _ = choose_tokens(logits, [row])
    assert (int(first[0]), int(second[0])) == (7, 8)


def test_log_softmax_and_top_logprobs() -> None:
    row = logits_batch(1, seed=3)[0]
    lp = log_softmax(row[None, :])[0]
    assert np.exp(lp).sum() == pytest.approx(1.0, abs=1e-5)
    best = top_logprobs(row, 3)
    assert [t for t, _ in best] == np.argsort(-row)[:3].tolist()
    assert [v for _, v in best] == pytest.approx(np.sort(lp)[::-1][:3].tolist(), abs=1e-6)
