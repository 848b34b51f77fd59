"""One engine step, whatever it carries: plan it, run it in one call, apply the result.

Every step is the same three moves (vLLM v1's ``schedule``, ``execute_model`` and
``update_from_output``):

1. ``plan_step`` says what each row feeds this step (service/engine/step_plan.py): the
   running rows their newest token, or that token and the drafts to verify where the
   speculator proposes some; the newcomers their whole prompts; one long prompt its next
   chunk. The rows take the slots they need here.
2. ``ModelRunner.run`` executes the plan, choosing the passes and graphs itself.
3. ``apply_step`` chooses every row's tokens from the result (the runner's picks, or
   sampling on the host; speculative acceptance for verified rows, whose rejected drafts
   leave the cache), and returns the events, each row's sequence matching stops and
   finishing (service/engine/sequence.py).

``run_step`` is the three in a row: the scheduler's step, and a batch's in tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from service.engine.batch import Batch
from service.engine.request import TokenEvent
from service.engine.runner import ModelRunner
from service.engine.speculative import Proposal, Speculator, accept
from service.engine.step_plan import StepPlan, StepResult, VerifyWork


@dataclass
class Step:
    """A step's plan and whose rows each part of it is."""

    plan: StepPlan
    running: Batch | None = None  # rows that decode, or verify drafts
    fresh: Batch | None = None  # newcomers: whole prompts
    partial: Batch | None = None  # one long prompt: its next chunk
    plain: list[int] | None = None  # running rows decoding one token (None: all of them)
    proposals: dict[int, Proposal] = field(default_factory=dict)  # row → drafts verified
    speculating: bool = False  # the speculator was asked for the running rows' drafts


@dataclass
class StepEvents:
    running: list[list[TokenEvent]] = field(default_factory=list)  # per row: 1 or more
    fresh: list[TokenEvent] = field(default_factory=list)  # each newcomer's first token
    partial: list[TokenEvent] = field(default_factory=list)  # its first, once the prompt is in


def plan_step(runner: ModelRunner, running: Batch | None = None, fresh: Batch | None = None,
              partial: Batch | None = None, chunk: int = 0,
              speculator: Speculator | None = None) -> Step:
    """The plan of one step: ``running`` decodes (with drafts where ``speculator`` proposes
    them), ``fresh`` is prefilled, and ``partial`` feeds its next ``chunk`` prompt tokens."""
    step = Step(StepPlan(), running, fresh, partial)
    decode = None
    verify: tuple[VerifyWork, ...] = ()
    if running is not None:
        step.speculating = speculator is not None and speculator.applies(len(running))
        if step.speculating:
            assert speculator is not None
            step.proposals = _proposals(runner, running, speculator)
        if step.proposals:
            step.plain = [i for i in range(len(running)) if i not in step.proposals]
            assert running.next_tokens is not None
            verify = tuple(VerifyWork(running.slots[i], np.concatenate(
                [running.next_tokens[i:i + 1], p.tokens]))  # (k + 1,)
                for i, p in step.proposals.items())
        if step.plain is None or step.plain:
            decode = running.decode_work(runner, step.plain)
    prompts = fresh.prompt_work(runner) if fresh is not None else None
    chunk_work = partial.chunk_work(runner, chunk) if partial is not None else None
    step.plan = StepPlan(decode, prompts, chunk_work, verify)
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
    events = StepEvents()
    plan, running = step.plan, step.running
    if running is not None:
        events.running = [[] for _ in running.sequences]
        if plan.decode is not None:
            if result.decode_ids is not None:
                taken = running.take_ids(result.decode_ids, step.plain)
            else:
                assert result.decode_logits is not None
                taken = running.take_logits(result.decode_logits, step.plain)
            for i, event in zip(step.plain or range(len(running)), taken, strict=True):
                events.running[i].append(event)
        if step.speculating and speculator is not None and "decode" in result.seconds:
            speculator.observe_plain(result.seconds["decode"])
        for (i, proposal), work, logits, seconds in zip(
                step.proposals.items(), plan.verify, result.verify, result.verify_seconds,
                strict=True):
            assert speculator is not None
            seq = running.sequences[i]
            logits = np.ascontiguousarray(logits, np.float32)  # (k + 1, V)
            verdict = accept(proposal.tokens.tolist(), logits, seq.sampler, proposal.probs,
                             seq.stop_ids)
            before = runner.cached_length(work.slot) - len(work.tokens)
            runner.truncate(work.slot, before + 1 + verdict.accepted)  # fed + kept drafts
            speculator.record(seq.request.id, verdict, seconds)
            events.running[i] = running.take_verified(i, verdict, logits)
    if step.fresh is not None:
        events.fresh = step.fresh.take_prompt_logits(result.prompts)
    if step.partial is not None and plan.chunk is not None:
        step.partial.prompt_done += len(plan.chunk.tokens)
        if step.partial.prompt_left == 0:  # the prompt is in: its first token
            assert result.chunk is not None
            events.partial = step.partial.take_logits(result.chunk)  # (1, V)
    return events


def run_step(runner: ModelRunner, running: Batch | None = None, fresh: Batch | None = None,
             partial: Batch | None = None, chunk: int = 0,
             speculator: Speculator | None = None) -> tuple[StepEvents, StepResult]:
    """Plan, run and apply one step (see the module docstring); its events and the
    runner's result (what each pass took). If the runner fails, the rows' state is as
    before the step, but for the slots it took (the caller releases them)."""
    step = plan_step(runner, running, fresh, partial, chunk, speculator)
    result = runner.run(step.plan)
    return apply_step(step, result, runner, speculator), result


def step_alone(runner: ModelRunner, batch: Batch, speculator: Speculator | None = None
               ) -> list[list[TokenEvent]]:
    """One step of ``batch`` with nothing beside it: its prompts while it has none in,
    else a decode step; each row's events (one, or more for verified drafts)."""
    if batch.is_prefilled:
        return run_step(runner, running=batch, speculator=speculator)[0].running
    return [[event] for event in run_step(runner, fresh=batch)[0].fresh]
