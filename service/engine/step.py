"""One engine step, whatever it carries: plan it, run it in one call, apply the result.

Every step is the same three moves (vLLM v1's ``schedule``, ``execute_model`` and
``update_from_output``):

1. ``plan_step`` lists what each row feeds this step (service/engine/step_plan.py): the
   running rows their newest token, with the drafts to verify where the speculator
   proposes some; the newcomers the rest of their prompts; one long prompt its next
   chunk. Rows without a slot take one here (``Batch.reserve``: the one place rows take
   KV memory).
2. ``ModelRunner.run`` executes the plan, packing the rows into passes itself.
3. ``apply_step`` gives each batch its rows' outputs: tokens chosen (the runner's picks,
   or sampling on the host), speculative acceptance for verified rows, whose rejected
   drafts leave the cache; each row's sequence matches stops and finishes
   (service/engine/sequence.py).

``run_step`` is the three in a row: the scheduler's step, and a batch's in tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from service.engine.batch import Batch
from service.engine.request import TokenEvent
from service.engine.runner import ModelRunner
from service.engine.speculative import Proposal, Speculator, accept
from service.engine.step_plan import StepPlan, StepResult


@dataclass
class StepEvents:
    running: list[list[TokenEvent]] = field(default_factory=list)  # per row: 1 or more
    fresh: list[TokenEvent] = field(default_factory=list)  # each newcomer's first token
    partial: list[TokenEvent] = field(default_factory=list)  # its first, once the prompt is in


@dataclass
class Step:
    """A step's plan, whose rows each span of it is, and, once run, its outcome."""

    plan: StepPlan
    running: Batch | None = None  # rows that decode, or verify drafts
    fresh: Batch | None = None  # newcomers: the rest of their prompts
    partial: Batch | None = None  # one long prompt: its next chunk
    proposals: dict[int, Proposal] = field(default_factory=dict)  # running row → drafts
    speculating: bool = False  # the speculator was asked for the running rows' drafts
    result: StepResult | None = None
    events: StepEvents = field(default_factory=StepEvents)

    def rows_of(self, batch: Batch | None) -> range:
        """The plan's rows of ``batch`` (running, fresh, partial: in that order)."""
        start = 0
        for part in (self.running, self.fresh, self.partial):
            if part is None:
                continue
            if part is batch:
                return range(start, start + len(part))
            start += len(part)
        return range(0)


def plan_step(runner: ModelRunner, running: Batch | None = None, fresh: Batch | None = None,
              partial: Batch | None = None, chunk: int = 0,
              speculator: Speculator | None = None) -> Step:
    """The plan of one step: ``running`` decodes (with drafts where ``speculator`` proposes
    them), ``fresh`` feeds its prompts, and ``partial`` its next ``chunk`` prompt tokens."""
    step = Step(StepPlan(()), running, fresh, partial)
    rows = []
    if running is not None:
        step.speculating = speculator is not None and speculator.applies(len(running))
        if step.speculating:
            assert speculator is not None
            step.proposals = _proposals(runner, running, speculator)
        rows += running.work(runner, drafts={i: p.tokens for i, p in step.proposals.items()})
    if fresh is not None:
        rows += fresh.work(runner)
    if partial is not None:
        rows += partial.work(runner, chunk)
    step.plan = StepPlan(tuple(rows))
    return step


def _proposals(runner: ModelRunner, running: Batch, speculator: Speculator
               ) -> dict[int, Proposal]:
    out = {}
    for i, seq in enumerate(running.sequences):
        proposal = speculator.propose(seq.request.id, [*seq.request.prompt_ids, *seq.output_ids],
                                      seq.sampler, running.draft_room(runner, i))
        if proposal is not None:
            out[i] = proposal
    return out


def apply_step(step: Step, result: StepResult, runner: ModelRunner,
               speculator: Speculator | None = None) -> StepEvents:
    """Every row's tokens and events from what the runner returned for ``step``."""
    step.result = result
    events = step.events
    rows, outputs = step.plan.rows, result.outputs
    running = step.running
    if running is not None:
        span = step.rows_of(running)
        events.running = [[] for _ in running.sequences]
        plain = [i for i in range(len(running)) if i not in step.proposals]
        if plain:
            taken = running.take([rows[span[i]] for i in plain],
                                 result.joined([span[i] for i in plain]), plain)
            for i, event in zip(plain, taken, strict=True):
                events.running[i].append(event)
            decoded = result.pass_of(span[plain[0]])
            if step.speculating and speculator is not None and set(decoded.rows) == {
                    span[i] for i in plain}:  # a pass of the plain rows alone
                speculator.observe_plain(decoded.seconds)
        for i, proposal in step.proposals.items():
            assert speculator is not None
            seq, work = running.sequences[i], rows[span[i]]
            logits = np.ascontiguousarray(outputs[span[i]], np.float32)  # (k + 1, V)
            verdict = accept(proposal.tokens.tolist(), logits, seq.sampler, proposal.probs,
                             seq.stop_ids)
            before = runner.cached_length(work.slot) - len(work.tokens)
            runner.truncate(work.slot, before + 1 + verdict.accepted)  # fed + kept drafts
            speculator.record(seq.request.id, verdict, result.pass_of(span[i]).seconds)
            events.running[i] = running.take_verified(i, verdict, logits)
    for batch, name in ((step.fresh, "fresh"), (step.partial, "partial")):
        if batch is not None:
            span = step.rows_of(batch)
            setattr(events, name, batch.take([rows[j] for j in span],
                                             [outputs[j] for j in span]))
    return events


def run_step(runner: ModelRunner, running: Batch | None = None, fresh: Batch | None = None,
             partial: Batch | None = None, chunk: int = 0,
             speculator: Speculator | None = None) -> Step:
    """Plan, run and apply one step (see the module docstring): the step with its result
    and events. If the runner fails, the rows' state is as before the step, but for the
    slots it took (the caller releases them)."""
    step = plan_step(runner, running, fresh, partial, chunk, speculator)
    apply_step(step, runner.run(step.plan), runner, speculator)
    return step


def step_alone(runner: ModelRunner, batch: Batch, speculator: Speculator | None = None
               ) -> list[list[TokenEvent]]:
    """One step of ``batch`` with nothing beside it: its prompts while it has none in,
    else a decode step; each row's events (one, or more for verified drafts)."""
    if batch.is_prefilled:
        return run_step(runner, running=batch, speculator=speculator).events.running
    return [[event] for event in run_step(runner, fresh=batch).events.fresh]
