"""Speculative decoding: propose a few tokens cheaply, verify them in one pass, keep a prefix.

At batch 1 a CPU decoder is bound by reading the weights once per token; a pass that
feeds ``k + 1`` tokens reads them once too, so every accepted draft token is a token for
free. Two proposers, as in vLLM and llama.cpp:

- ``NgramProposer`` (prompt lookup; vLLM's ``ngram``, llama.cpp's lookup decoding): the
  last n tokens of the sequence are searched for earlier in the prompt and output, and
  the tokens that followed their latest occurrence are proposed. No second model; it pays
  on repetitive work (code editing, extraction, quoting), and proposes nothing otherwise.
- a draft model (service/engine/draft.py): a smaller model with the same tokenizer.

Verification (``accept``) is the standard rule (Leviathan et al. 2023; Chen et al. 2023):
draft token x with draft probability q(x) is kept with probability min(1, p(x) / q(x))
under the target's processed distribution p; at the first rejection a token is drawn from
the residual max(0, p − q), renormalised; when every draft is kept, one more token comes
from the target's last position (the "bonus" token). The output distribution is exactly
the target's. For greedy rows the rule reduces to "keep while the draft is the argmax",
so greedy text is identical with speculation on and off. A prompt-lookup draft is a point
mass (q(x) = 1), so its draft is kept with probability p(x) and the residual is p without x.

Penalties, bias and min_tokens depend on the tokens before each position, so the
sampler observes each kept token before the next position is judged. A grammar
constraint cannot be rewound, so rows with one do not speculate.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from service.engine.request import SamplingParams
from service.engine.sampling import RowSampler, warp
from service.engine.stats import SpeculationStats
from service.settings import default_of

Method = Literal["ngram", "draft"]


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """How to speculate: vLLM's ``--speculative-config`` fields where they exist, each
    setting by its Settings name and default (the engine builds it by name)."""

    method: Method = "ngram"
    # k: drafted tokens per verification pass
    num_speculative_tokens: int = default_of("num_speculative_tokens")
    prompt_lookup_max: int = default_of("prompt_lookup_max")  # longest n-gram searched for
    prompt_lookup_min: int = default_of("prompt_lookup_min")  # shortest accepted as a match
    # speculate only while the batch has at most this many rows
    speculative_max_batch_rows: int = default_of("speculative_max_batch_rows")
    # False: propose every step, paying or not (to measure acceptance)
    speculative_adaptive: bool = default_of("speculative_adaptive")
    probe_budget: float = 0.02  # share of plain speed spent re-testing speculation that lost
    max_pause: int = 512  # longest run of plain steps between two such tests

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.speculative_max_batch_rows < 1:
            raise ValueError("speculative_max_batch_rows must be at least 1")
        if not 0.0 < self.probe_budget <= 1.0 or self.max_pause < 1:
            raise ValueError("need 0 < probe_budget <= 1 and max_pause >= 1")


class NgramProposer:
    """Prompt lookup: the tokens after the latest earlier occurrence of the longest suffix."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.n_max = config.prompt_lookup_max
        self.n_min = config.prompt_lookup_min

    def propose(self, history: np.ndarray) -> np.ndarray:
        """Up to k token ids to follow ``history`` (L,) int64; empty when nothing matches."""
        length = history.shape[0]
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            suffix = history[length - n:]  # (n,)
            # Windows that start early enough to have at least one token after them.
            windows = np.lib.stride_tricks.sliding_window_view(history[:length - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))  # (matches,)
            if hits.size:
                start = int(hits[-1]) + n  # the latest occurrence: recent text is copied most
                return history[start:start + self.k].copy()
        return history[:0].copy()


@dataclass
class Verdict:
    """What one verification pass produced for a row: tokens and where their logits are."""

    tokens: list[int]  # kept drafts, then the corrected or bonus token (1..k+1 tokens)
    positions: list[int]  # logits row of each token (its position in the verified pass)
    drafted: int  # draft tokens that were judged

    @property
    def accepted(self) -> int:
        """Draft tokens kept (the last token is the target's own)."""
        return len(self.tokens) - 1


def accept(drafts: Sequence[int], logits: np.ndarray, sampler: RowSampler,
           draft_probs: np.ndarray | None = None, stop_ids: frozenset[int] = frozenset()
           ) -> Verdict:
    """Judge ``drafts`` (k,) against the target's ``logits`` (k + 1, V) for one row.

    ``logits[i]`` is the target's prediction after the i-th fed token (the row's last
    sampled token, then drafts[:i]). ``draft_probs`` (k, V) is the draft's distribution at
    each position (None: a point mass on each draft, as prompt lookup proposes). The
    sampler observes every token returned, so its penalties and generator advance exactly
    as they would decoding one token at a time. Judging stops after a token in
    ``stop_ids`` (end of sequence): nothing after it is kept.
    """
    k = len(drafts)
    if logits.shape[0] != k + 1:
        raise ValueError(f"{k} drafts need {k + 1} rows of logits, got {logits.shape[0]}")
    tokens: list[int] = []
    for i, draft in enumerate(drafts):
        token, kept = _judge(int(draft), logits[i], sampler,
                             None if draft_probs is None else draft_probs[i])
        sampler.observe(token)
        tokens.append(token)
        if not kept or token in stop_ids:
            return Verdict(tokens, list(range(len(tokens))), i + 1)
    bonus = sampler.choose(logits[k])
    sampler.observe(bonus)
    tokens.append(bonus)
    return Verdict(tokens, list(range(k + 1)), k)


def _judge(draft: int, logits: np.ndarray, sampler: RowSampler,
           q: np.ndarray | None) -> tuple[int, bool]:
    """(token, whether it is the draft) at one position, by the speculative sampling rule."""
    if sampler.rng is None:  # greedy: the draft survives only as the argmax
        best = int(np.argmax(sampler.processed_logits(logits)))
        return best, best == draft
    p = warp(sampler.processed_logits(logits), sampler.params)  # (V,) target probabilities
    q_draft = 1.0 if q is None else float(q[draft])
    if q_draft > 0.0 and sampler.rng.random() * q_draft < p[draft]:  # u < p(x) / q(x)
        return draft, True
    if q is None:
        residual = p.copy()
        residual[draft] = 0.0
    else:
        residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    if total <= 0.0:  # p == q: the rejection had probability 0; draw from p
        residual, total = p, p.sum()
    cdf = np.cumsum(residual)
    u = sampler.rng.random() * total
    return int(min(np.searchsorted(cdf, u, side="right"), residual.shape[0] - 1)), False


@dataclass
class PassCosts:
    """Measured seconds of the passes a speculating step is made of (moving averages).

    Whether speculation pays depends on the machine and the draft: a prompt-lookup
    proposal costs a search, a draft model's costs k of its own steps, and a verification
    pass costs a little more than a plain step. Measured, not assumed.
    """

    plain: float | None = None  # one decode pass, one token per row
    propose: float | None = None  # one proposal (prompt lookup's search; the draft's steps)
    verify: float | None = None  # one row's verification pass of k + 1 tokens
    weight: float = 0.2  # share of a new measurement in the average

    def observe(self, kind: Literal["plain", "propose", "verify"], seconds: float) -> None:
        setattr(self, kind, moving_average(getattr(self, kind), seconds, self.weight))

    def round_in_plain_steps(self) -> float | None:
        """What one propose + verify round costs, in plain decode steps (None: unmeasured)."""
        if self.plain is None or self.propose is None or self.verify is None:
            return None
        return (self.propose + self.verify) / max(self.plain, 1e-9)


ROUND_WEIGHT = 0.3  # share of a new round in the tokens-per-round averages


@dataclass
class RowSpeculation:
    """One sequence's speculation policy: speculate while a round beats plain decoding.

    ``tokens_per_round`` is a moving average of the tokens a verification pass yields
    (kept drafts + the target's own). A round pays when it yields more tokens than the
    plain steps it costs (``PassCosts.round_in_plain_steps``). When it does not, the row
    decodes plainly for a pause sized so that the next probe round's expected loss is
    ``probe_budget`` of the plain steps in between: a prompt-lookup miss (a tenth of a
    step lost) pauses a few steps, a poor draft model's miss (three steps lost) pauses
    about 150. This is what keeps speculation within a few percent of off when its
    proposals are rejected (free chat, a weak draft).
    """

    tokens_per_round: float | None  # None: no round judged yet, here or in the engine
    pause: int = 0  # steps to decode plainly before proposing again

    def wants_proposal(self) -> bool:
        if self.pause > 0:
            self.pause -= 1
            return False
        return True

    def record(self, verdict: Verdict) -> None:
        if verdict.drafted:
            self.tokens_per_round = moving_average(self.tokens_per_round,
                                                   verdict.accepted + 1, ROUND_WEIGHT)

    def decide(self, round_cost: float | None, probe_budget: float, max_pause: int) -> None:
        """Set the pause from the round's cost in plain steps (None: not yet measured)."""
        self.pause = pause_for(self.tokens_per_round, round_cost, probe_budget, max_pause)


def moving_average(old: float | None, new: float, weight: float) -> float:
    return new if old is None else old + weight * (new - old)


def pause_for(tokens_per_round: float | None, round_cost: float | None, probe_budget: float,
              max_pause: int) -> int:
    """Plain steps before the next round: 0 while a round pays (or is not yet measured)."""
    if tokens_per_round is None or round_cost is None:
        return 0
    loss = round_cost - tokens_per_round  # plain steps a round loses against decoding
    if loss <= 0.0:
        return 0
    return min(max_pause, max(1, math.ceil(loss / probe_budget)))


@dataclass
class SpeculationCounters:
    """Cumulative counts, as vLLM's spec-decode metrics name them."""

    drafts: int = 0  # verification passes that carried at least one draft token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    paused_steps: int = 0  # row steps decoded plainly because speculation did not pay

    def record(self, verdict: Verdict) -> None:
        if not verdict.drafted:
            return
        self.drafts += 1
        self.draft_tokens += verdict.drafted
        self.accepted_tokens += verdict.accepted
        if len(self.accepted_per_position) < verdict.drafted:
            self.accepted_per_position.extend(
                [0] * (verdict.drafted - len(self.accepted_per_position)))
        for i in range(verdict.accepted):
            self.accepted_per_position[i] += 1


@dataclass(frozen=True)
class Proposal:
    tokens: np.ndarray  # (k,) drafted ids
    probs: np.ndarray | None  # (k, V) the draft's distributions (None: point masses)


class Drafter(Protocol):
    """A draft model (service/engine/draft.py): proposals per sequence, keyed by request."""

    def propose(self, key: int, history: Sequence[int], params: SamplingParams,
                seed: int | None) -> Proposal: ...

    def release(self, key: int) -> None: ...


class Speculator:
    """The engine's speculation policy: who proposes, for which rows, and the counts.

    Speculation runs while the batch has at most ``speculative_max_batch_rows`` rows: a verification
    pass feeds one row's tokens (engine.onnx takes several new tokens over a cache one row
    at a time), so at larger batches one batched decode step is the better use of a pass
    over the weights (vLLM disables speculation by batch size for the same reason).

    Each row speculates only while its rounds pay for themselves (``RowSpeculation``),
    judged by pass costs measured on this machine (``PassCosts``). A new row starts from
    what earlier rows yielded, so once a draft is known not to pay here, later requests
    start out decoding plainly rather than each paying to find out.
    """

    def __init__(self, config: SpeculativeConfig, draft: Drafter | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if (config.method == "draft") != (draft is not None):
            raise ValueError("draft speculation needs a draft model, and only it")
        self.config = config
        self.clock = clock  # times proposals
        self.ngram = NgramProposer(config)
        self.draft = draft
        self.costs = PassCosts()
        self.counters = SpeculationCounters()
        self.tokens_per_round: float | None = None  # over all rows' recent rounds
        self._rows: dict[int, RowSpeculation] = {}

    def applies(self, rows: int) -> bool:
        return rows <= self.config.speculative_max_batch_rows

    def propose(self, key: int, history: Sequence[int], sampler: RowSampler,
                room: int) -> Proposal | None:
        """At most ``room`` drafted tokens to follow ``history`` (prompt + output so far),
        or None: the row decodes one token as usual this step."""
        if room < 1 or sampler.constraint is not None:
            return None
        row = self._row(key)
        if self.config.speculative_adaptive and self.costs.plain is None:
            return None  # a plain step's cost is the yardstick: measure it first
        if not row.wants_proposal():
            self.counters.paused_steps += 1
            return None
        started = self.clock()
        if self.draft is not None:
            drafted = self.draft.propose(key, history, sampler.params, sampler.seed)
            tokens, probs = drafted.tokens[:room], drafted.probs
            probs = None if probs is None else probs[:len(tokens)]
        else:
            tokens, probs = self.ngram.propose(np.asarray(history, np.int64))[:room], None
        if not len(tokens):
            return None
        self.costs.observe("propose", self.clock() - started)
        return Proposal(tokens, probs)

    def observe_plain(self, seconds: float) -> None:
        """A decode pass without drafts took ``seconds``."""
        self.costs.observe("plain", seconds)

    def record(self, key: int, verdict: Verdict, verify_seconds: float) -> None:
        """A row's verification pass took ``verify_seconds`` and gave ``verdict``."""
        self.costs.observe("verify", verify_seconds)
        row = self._row(key)
        row.record(verdict)
        if verdict.drafted:
            self.tokens_per_round = moving_average(self.tokens_per_round,
                                                   verdict.accepted + 1, ROUND_WEIGHT)
        self._decide(row)
        self.counters.record(verdict)

    def _row(self, key: int) -> RowSpeculation:
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = RowSpeculation(self.tokens_per_round)
            self._decide(row)
        return row

    def _decide(self, row: RowSpeculation) -> None:
        if self.config.speculative_adaptive:
            row.decide(self.costs.round_in_plain_steps(), self.config.probe_budget,
                       self.config.max_pause)

    def stats(self) -> SpeculationStats:
        c = self.counters
        return SpeculationStats(c.drafts, c.draft_tokens, c.accepted_tokens,
                                tuple(c.accepted_per_position), c.paused_steps)

    def release(self, key: int) -> None:
        """The sequence left the engine."""
        self._rows.pop(key, None)
        if self.draft is not None:
            self.draft.release(key)
