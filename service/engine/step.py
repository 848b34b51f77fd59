"""One engine step, whatever it carries: its rows, run in one call, each given its result.

Every step is the same three moves (vLLM v1's ``schedule``, ``execute_model`` and
``update_from_output``):

1. The scheduler builds the ``Step``: each batch it steps adds its rows (``Step.add``).
   A row (``StepRow``) is a request's state (its batch and row there), what it feeds
   (``RowWork``, service/engine/step_plan.py: a running row its newest token, with the
   drafts to verify where the speculator proposes some; a newcomer the rest of its
   prompt; a long prompt its next chunk) and what it takes back: a token where it
   ``samples`` (a decoding row, a prompt's last part; not a middle chunk), what
   verification keeps where it has drafts. Rows without a slot take one here
   (``Batch.reserve``: the one place rows take KV memory).
2. ``ModelRunner.run`` executes the rows' plan, packing them into passes itself.
3. ``apply_step`` gives each row its output, one path for every row: the part of its
   prompt it fed is in; then it takes its token (the runner's pick, or chosen on the
   host from its logits), or verification's verdict on its drafts, whose rejected ones
   leave the cache; each row's sequence matches stops and finishes
   (service/engine/sequence.py).

``run_step`` is 2 and 3: the scheduler's step, and a batch's in tests (``step_alone``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import groupby

import numpy as np

from service.engine.batch import Batch
from service.engine.request import TokenEvent
from service.engine.runner import ModelRunner
from service.engine.sampling import choose_tokens
from service.engine.sequence import SequenceState
from service.engine.speculative import Proposal, Speculator, accept
from service.engine.step_plan import RowWork, StepPlan, StepResult


@dataclass(slots=True)
class StepRow:
    """One row of a step: row ``index`` of ``batch`` (the request's state: its sequence,
    slot and newest token), what it feeds (``work``), whether a token comes of it
    (``samples``), the drafts it verifies (``proposal``), and, once applied, its events."""

    batch: Batch
    index: int
    work: RowWork
    samples: bool
    proposal: Proposal | None = None
    events: list[TokenEvent] = field(default_factory=list)

    @property
    def sequence(self) -> SequenceState:
        return self.batch.sequences[self.index]


@dataclass
class Step:
    """The rows of one step and, once run, its result."""

    rows: list[StepRow] = field(default_factory=list)
    plain: list[int] = field(default_factory=list)  # rows the speculator gave no drafts
    result: StepResult | None = None

    @property
    def plan(self) -> StepPlan:
        return StepPlan(tuple(r.work for r in self.rows))

    def add(self, runner: ModelRunner, batch: Batch | None, chunk: int = 0,
            speculator: Speculator | None = None) -> Step:
        """``batch``'s rows join the step (None: none): a prefilled batch decodes, with
        drafts where ``speculator`` proposes them; another feeds its prompts, at most
        ``chunk`` tokens a row (0: the rest)."""
        if batch is None:
            return self
        proposals: dict[int, Proposal] = {}
        if speculator is not None and batch.is_prefilled and speculator.applies(len(batch)):
            proposals = _proposals(runner, batch, speculator)
            self.plain += [len(self.rows) + i for i in range(len(batch)) if i not in proposals]
        work = batch.work(runner, chunk, {i: p.tokens for i, p in proposals.items()})
        self.rows += [StepRow(batch, i, w, batch.completes(i, w), proposals.get(i))
                      for i, w in enumerate(work)]
        return self

    def rows_of(self, batch: Batch | None) -> list[int]:
        """The step's rows of ``batch``, as indices into its plan."""
        return [j for j, r in enumerate(self.rows) if r.batch is batch]


def _proposals(runner: ModelRunner, batch: Batch, speculator: Speculator
               ) -> dict[int, Proposal]:
    out = {}
    for i, seq in enumerate(batch.sequences):
        proposal = speculator.propose(seq.request.id, [*seq.request.prompt_ids, *seq.output_ids],
                                      seq.sampler, batch.draft_room(runner, i))
        if proposal is not None:
            out[i] = proposal
    return out


def apply_step(step: Step, result: StepResult, runner: ModelRunner,
               speculator: Speculator | None = None) -> None:
    """Each row of ``step`` takes its output of ``result``: its tokens and events."""
    step.result = result
    rows, outputs = step.rows, result.outputs
    for row, output in zip(rows, outputs, strict=True):
        row.batch.fed(row.index, row.work, output)
    # rows that take one token choose it together, as one array: ids or logits
    taking = [j for j, r in enumerate(rows) if r.samples and r.proposal is None]
    for _, group in groupby(taking, key=lambda j: outputs[j].ndim):
        js = list(group)
        _take([rows[j] for j in js], result.joined(js))
    if step.plain and speculator is not None:
        decoded = result.pass_of(step.plain[0])
        if set(decoded.rows) == set(step.plain):  # a pass of the plain rows alone
            speculator.observe_plain(decoded.seconds)
    for j, row in enumerate(rows):
        if row.proposal is not None:
            assert speculator is not None
            _verify(row, np.ascontiguousarray(outputs[j], np.float32), runner, speculator,
                    result.pass_of(j).seconds)


def _take(rows: list[StepRow], out: np.ndarray) -> None:
    """``rows`` take their next tokens: ``out`` (R,), the runner's picks, or the rows'
    last logits (R, V) to choose them from."""
    seqs = [r.sequence for r in rows]
    logits = None
    logprobs: list[float | None] = [None] * len(rows)
    if out.ndim == 1:
        tokens = out.tolist()
        for seq, token in zip(seqs, tokens, strict=True):
            seq.sampler.observe(token)
    else:
        logits = np.ascontiguousarray(out, np.float32)
        chosen, lps = choose_tokens(logits, [s.sampler for s in seqs],
                                    [s.request.token_logprobs for s in seqs])
        tokens = chosen.tolist()
        logprobs = [s.reported(lp) for s, lp in zip(seqs, lps, strict=True)]
    now = time.perf_counter()
    for j, row in enumerate(rows):
        row.events.append(row.batch.advance(row.index, tokens[j], logprobs[j],
                                            None if logits is None else logits[j], now))


def _verify(row: StepRow, logits: np.ndarray, runner: ModelRunner, speculator: Speculator,
            seconds: float) -> None:
    """The row keeps what verification accepts of its drafts, judged on its logits
    (k + 1, V); the rejected drafts leave its cache."""
    seq, work, proposal = row.sequence, row.work, row.proposal
    assert proposal is not None
    verdict = accept(proposal.tokens.tolist(), logits, seq.sampler, proposal.probs,
                     seq.stop_ids)
    before = runner.cached_length(work.slot) - len(work.tokens)
    runner.truncate(work.slot, before + 1 + verdict.accepted)  # fed + kept drafts
    speculator.record(seq.request.id, verdict, seconds)
    row.events = row.batch.take_verified(row.index, verdict, logits)


def run_step(runner: ModelRunner, step: Step, speculator: Speculator | None = None) -> Step:
    """Run and apply ``step`` (see the module docstring): the step with its result and
    each row's events. If the runner fails, the rows' state is as before the step, but
    for the slots they took (the caller releases them)."""
    apply_step(step, runner.run(step.plan), runner, speculator)
    return step


def step_alone(runner: ModelRunner, batch: Batch, speculator: Speculator | None = None
               ) -> list[list[TokenEvent]]:
    """One step of ``batch`` with nothing beside it: its prompts while it has none in,
    else a decode step; each row's events (one, or more for verified drafts)."""
    step = run_step(runner, Step().add(runner, batch, speculator=speculator), speculator)
    return [r.events for r in step.rows]
