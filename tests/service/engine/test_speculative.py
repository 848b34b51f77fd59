"""Speculative decoding's two halves, against plain references: prompt lookup against a
brute-force search, and the verification rule against the target distribution it must
preserve (a chi-square test over many draws) and against one-token-at-a-time greedy."""

from __future__ import annotations

import numpy as np
import pytest

from service.engine.request import SamplingParams
from service.engine.sampling import RowSampler, warp
from service.engine.speculative import (
    NgramProposer,
    PassCosts,
    Proposal,
    RowSpeculation,
    SpeculationCounters,
    SpeculativeConfig,
    Speculator,
    Verdict,
    accept,
)

V = 8


def brute_force_lookup(history: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The reference: for the longest n first, scan every earlier window by hand."""
    length = len(history)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = history[length - n:]
        latest = None
        for i in range(0, length - n):  # windows ending before the last token
            if history[i:i + n] == suffix:
                latest = i
        if latest is not None:
            return history[latest + n:latest + n + k]
    return []


@pytest.mark.parametrize("seed", range(20))
def test_ngram_proposals_match_a_brute_force_search(seed: int) -> None:
    rng = np.random.default_rng(seed)
    config = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                               prompt_lookup_max=3)
    proposer = NgramProposer(config)
    for _ in range(20):
        history = rng.integers(0, 4, size=int(rng.integers(1, 40))).tolist()
        got = proposer.propose(np.asarray(history, np.int64)).tolist()
        assert got == brute_force_lookup(history, 3, 1, 3), history


def test_ngram_copies_the_text_after_the_latest_occurrence() -> None:
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=4))
    history = np.asarray([5, 6, 7, 1, 2, 9, 9, 5, 6, 7, 3, 4, 8, 5, 6, 7], np.int64)
    assert proposer.propose(history).tolist() == [3, 4, 8, 5]  # after the second "5 6 7"
    assert proposer.propose(np.asarray([1, 2, 3, 4], np.int64)).tolist() == []


def test_config_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2)


def _greedy_one_at_a_time(logits: np.ndarray, params: SamplingParams) -> list[int]:
    """What plain decoding picks at each position, observing each pick before the next."""
    sampler = RowSampler(params, V, [0])
    out = []
    for row in logits:
        token = sampler.choose(row)
        sampler.observe(token)
        out.append(token)
    return out


@pytest.mark.parametrize("params", [SamplingParams(),
                                    SamplingParams(repetition_penalty=3.0),
                                    SamplingParams(frequency_penalty=2.0)])
def test_greedy_verification_keeps_exactly_the_plain_greedy_prefix(
        params: SamplingParams) -> None:
    rng = np.random.default_rng(1)
    for _ in range(200):
        logits = rng.normal(size=(5, V))  # (k + 1, V)
        plain = _greedy_one_at_a_time(logits, params)
        agree = int(rng.integers(0, 5))  # drafts right for this many positions, then wrong
        drafts = plain[:agree] + [(t + 1) % V for t in plain[agree:4]]
        verdict = accept(drafts, logits, RowSampler(params, V, [0]))
        # Penalties can change the argmax after a kept token: the reference agrees.
        assert verdict.tokens == plain[:len(verdict.tokens)]
        assert verdict.accepted == min(agree, 4)
        assert len(verdict.tokens) == min(agree, 4) + 1


def test_a_stop_token_ends_the_verdict() -> None:
    logits = np.full((4, V), -5.0)
    logits[:, 2] = 5.0  # the target wants token 2 everywhere
    verdict = accept([2, 2, 2], logits, RowSampler(SamplingParams(), V, [0]),
                     stop_ids=frozenset({2}))
    assert verdict.tokens == [2] and verdict.drafted == 1


# The chi-square distribution's 0.999 quantile by degrees of freedom (standard tables).
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def _chi_square_fits(counts: np.ndarray, probs: np.ndarray) -> bool:
    """Pearson's test at the 0.1% level: do ``counts`` look drawn from ``probs``?"""
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token the target gives probability 0 was emitted"
    expected = probs[keep] * counts.sum()
    statistic = float(((counts[keep] - expected) ** 2 / expected).sum())
    return statistic < CHI2_999[int(keep.sum()) - 1]


@pytest.mark.parametrize("draft_kind", ["point", "model"])
def test_sampled_verification_preserves_the_target_distribution(draft_kind: str) -> None:
    """The first emitted token is distributed as the target's p, whatever the draft proposes
    (Leviathan et al. 2023, Theorem 1); a draft far from p only lowers acceptance."""
    params = SamplingParams(do_sample=True, temperature=0.8, top_k=6, seed=7)
    target_logits = np.array([2.0, 1.5, 0.3, -0.2, 0.9, -1.0, 0.1, 1.1])
    p = warp(target_logits.astype(np.float64), params)  # (V,) what plain sampling draws from
    q = np.array([0.05, 0.05, 0.4, 0.1, 0.1, 0.1, 0.1, 0.1])  # a poor draft distribution
    logits = np.stack([target_logits, target_logits])  # (k + 1, V), k = 1
    draws = np.random.default_rng(3)
    sampler = RowSampler(params, V, [0])
    counts = np.zeros(V, np.int64)
    accepted = 0
    trials = 20000
    for _ in range(trials):
        if draft_kind == "point":
            draft, probs = 2, None  # prompt lookup always proposes token 2
        else:
            draft, probs = int(draws.choice(V, p=q)), q[None, :]
        verdict = accept([draft], logits, sampler, draft_probs=probs)
        counts[verdict.tokens[0]] += 1
        accepted += verdict.accepted
    assert _chi_square_fits(counts, p), (counts / trials, p)
    # Acceptance is sum(min(p, q)) for a model draft, p(2) for a point draft.
    expected = p[2] if draft_kind == "point" else np.minimum(p, q).sum()
    assert abs(accepted / trials - expected) < 0.02


def test_counters_follow_vllms_definitions() -> None:
    miss = Verdict(tokens=[4], positions=[0], drafted=3)
    hit = Verdict(tokens=[4, 5, 6], positions=[0, 1, 2], drafted=3)
    counters = SpeculationCounters()
    for verdict in (miss, hit, Verdict(tokens=[7], positions=[0], drafted=0)):
        counters.record(verdict)
    assert (counters.drafts, counters.draft_tokens, counters.accepted_tokens) == (2, 6, 2)
    assert counters.accepted_per_position == [1, 1, 0]


def test_a_losing_round_pauses_in_proportion_to_what_it_lost() -> None:
    costs = PassCosts(plain=0.020, propose=0.060, verify=0.022)  # a round: 4.1 plain steps
    row = RowSpeculation(tokens_per_round=None)
    row.record(Verdict(tokens=[4], positions=[0], drafted=4))  # every draft rejected
    row.decide(costs.round_in_plain_steps(), probe_budget=0.02, max_pause=512)
    # Lost 4.1 - 1 = 3.1 plain steps; at 2 % of the plain steps between probes: 155.
    assert row.pause == 155
    assert [row.wants_proposal() for _ in range(156)] == [False] * 155 + [True]
    # Prompt lookup's miss costs a search and a slightly wider pass: a short pause.
    cheap = PassCosts(plain=0.020, propose=0.0001, verify=0.022)
    row.decide(cheap.round_in_plain_steps(), probe_budget=0.02, max_pause=512)
    assert row.pause == 6  # ceil((1.105 - 1) / 0.02)
    # A full round moves the average 30 % of the way: 1 + 0.3 * 4 = 2.2 tokens a round,
    # which pays for prompt lookup's round and not for the draft's.
    row.record(Verdict(tokens=[1, 2, 3, 4, 5], positions=[0, 1, 2, 3, 4], drafted=4))
    assert row.tokens_per_round == pytest.approx(2.2)
    row.decide(cheap.round_in_plain_steps(), probe_budget=0.02, max_pause=512)
    assert row.pause == 0
    row.decide(costs.round_in_plain_steps(), probe_budget=0.02, max_pause=512)
    assert row.pause == 95  # ceil((4.1 - 2.2) / 0.02)
    with pytest.raises(ValueError, match="probe_budget"):
        SpeculativeConfig(probe_budget=0.0)


class _FixedDraft:
    """A draft that proposes k tokens in ``cost`` seconds of a simulated clock."""

    def __init__(self, clock: list[float], cost: float, k: int) -> None:
        self.clock, self.cost, self.k = clock, cost, k

    def propose(self, key: int, history: object, params: SamplingParams,
                seed: int | None) -> Proposal:
        self.clock[0] += self.cost
        return Proposal(np.arange(self.k, dtype=np.int64), None)

    def release(self, key: int) -> None:
        pass


@pytest.mark.parametrize("kept", [0, 4])
def test_speculation_costs_at_most_its_probe_budget_when_it_does_not_pay(kept: int) -> None:
    """Ten requests of 128 tokens on a simulated clock (a plain step 1 s, a draft 3 s, a
    verification 1.1 s): a draft that is always rejected must cost no more than plain
    decoding plus the probe budget; one that is always kept must keep speculating."""
    clock = [0.0]
    k = 4
    spec = Speculator(SpeculativeConfig(method="draft", num_speculative_tokens=k),
                      _FixedDraft(clock, 3.0, k), clock=lambda: clock[0])
    sampler = RowSampler(SamplingParams(), vocab_size=V, prompt_ids=[1, 2, 3])
    tokens = 0
    for key in range(10):
        made = 0
        while made < 128:
            proposal = spec.propose(key, [1, 2, 3], sampler, room=k)
            if proposal is None:  # a plain decode step
                clock[0] += 1.0
                spec.observe_plain(1.0)
                made += 1
                continue
            clock[0] += 1.1
            spec.record(key, Verdict(list(range(kept + 1)), list(range(kept + 1)),
                                     min(kept + 1, k)), 1.1)
            made += kept + 1
        tokens += made
        spec.release(key)
    seconds_per_token = clock[0] / tokens
    if kept == 0:
        assert seconds_per_token <= 1.0 * 1.03  # plain decoding: 1 s a token
        assert spec.counters.paused_steps > 1000
    else:
        assert seconds_per_token == pytest.approx(4.1 / 5, rel=0.02)  # one round, 5 tokens
        assert spec.counters.paused_steps == 0
