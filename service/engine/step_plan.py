"""One engine step as data: a flat list of rows, each feeding tokens after its cache.

The scheduler describes every step the same way (vLLM v1's ``SchedulerOutput``, whose
``num_scheduled_tokens`` per request is all a step is): for each row its slot, the tokens
it feeds after what the slot holds (and whether it holds nothing: ``first``), what it
wants back, and what it is computed under (its ``ModelVariant``: the LoRA adapter and the
control vector). A running row feeds its newest token; a newcomer its whole prompt (or what
follows a cached prefix); a long prompt its next chunk; a speculating row its newest token
and the drafts to verify. They are the same thing to the runner, which packs the rows into
as few passes as its graph allows (``ModelRunner.run``) and returns, per row, only numbers.
Turning them into tokens and events is ``apply_step``'s (service/engine/step.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from service.engine.kv_pool import Slot
from service.engine.request import BASE, ModelVariant

# What a row wants back: the last position's logits (1, V), every fed position's (T, V),
# or only its next token (1,) chosen beside the logits: the argmax, or a draw with the
# row's ``RowDraw`` (runners that sample on the device only, ``samples_on_device``).
Want = Literal["last", "every", "argmax", "draw"]


@dataclass(frozen=True)
class RowDraw:
    """One row's sampling on the device: its warpers and this step's uniform in [0, 1)."""

    temperature: float
    top_k: int
    top_p: float  # above 1: off
    u: float


@dataclass(frozen=True)
class RowWork:
    """One row's part of a step: ``tokens`` fed after the ``slot``'s cached tokens, and
    everything else a pass needs of the row, set from its request when the batch makes
    it: the runner keeps nothing per row but the slot's cache."""

    slot: Slot
    tokens: np.ndarray  # (T,) int64
    want: Want = "last"
    draw: RowDraw | None = None  # for want "draw"
    # the slot holds nothing before it (a prompt from its start): such rows prefill
    # together, as GroupQueryAttention takes several rows of many tokens only so
    first: bool = False
    drafted: bool = False  # tokens after the first are drafts: never prefix-cached
    # what computes the row besides the base weights (its LoRA adapter and control
    # vector): every pass applies it, and the prefix cache keys the row's blocks by it
    variant: ModelVariant = BASE


@dataclass(frozen=True)
class StepPlan:
    rows: tuple[RowWork, ...]


@dataclass(frozen=True)
class PassTime:
    """One forward pass of a step: the plan's rows it carried and what it took."""

    rows: tuple[int, ...]
    seconds: float


@dataclass
class StepResult:
    """Per plan row what it wanted, and the passes the runner made of the plan."""

    outputs: list[np.ndarray]  # (1, V) or (T, V) float32 logits; (1,) int64 for a token
    passes: list[PassTime] = field(default_factory=list)
    # plan rows → their outputs as one array, where a pass returned them so: (R, V)
    # logits or (R,) ids, of which ``outputs`` holds row views
    together: dict[tuple[int, ...], np.ndarray] = field(default_factory=dict)

    def joined(self, rows: Sequence[int]) -> np.ndarray:
        """The last position's outputs of ``rows`` as one array, (R, V) or (R,): the pass's
        own where it returned exactly those rows (no copy of B x V floats a step), else
        joined."""
        block = self.together.get(tuple(rows))
        return block if block is not None else np.concatenate(
            [self.outputs[i][-1:] for i in rows])

    def seconds_of(self, rows: Sequence[int]) -> float:
        """What the passes carrying any of ``rows`` took (each pass once)."""
        wanted = set(rows)
        return sum(p.seconds for p in self.passes if wanted.intersection(p.rows))

    def pass_of(self, row: int) -> PassTime:
        return next(p for p in self.passes if row in p.rows)
