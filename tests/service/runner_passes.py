"""One kind of pass at a time through ``ModelRunner.run``: what the runner tests feed.

The runner packs a step's rows into passes itself (service/engine/pooled_runner.py); these
helpers give it plans that are one pass each (rows into empty slots, one token a row, one
row after its cache), so a test can compare one pass against a reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from service.engine.cuda import SampledRows
from service.engine.kv_pool import Slot
from service.engine.runner import ModelRunner
from service.engine.step_plan import RowDraw, RowWork, StepPlan, Want


def prefill(runner: ModelRunner, slots: Sequence[Slot], prompts: Sequence[np.ndarray],
            every: bool = False) -> list[np.ndarray]:
    """Whole prompts into empty slots: (T_i, V) each with ``every``, else (1, V)."""
    want: Want = "every" if every else "last"
    return run_rows(runner, [RowWork(s, np.asarray(p, np.int64), want, first=True)
                             for s, p in zip(slots, prompts, strict=True)])


def decode(runner: ModelRunner, slots: Sequence[Slot], tokens: np.ndarray) -> np.ndarray:
    """One token a row after its cache: logits (B, V)."""
    return np.concatenate(run_rows(runner, [RowWork(s, np.asarray([t], np.int64)) for s, t
                                            in zip(slots, tokens, strict=True)]))


def decode_ids(runner: ModelRunner, slots: Sequence[Slot], tokens: np.ndarray,
               sampled: SampledRows | None = None) -> np.ndarray:
    """One token a row, the runner picking the next: the argmax, or ``sampled``'s draws."""
    if sampled is None:
        rows = [RowWork(s, np.asarray([t], np.int64), "argmax")
                for s, t in zip(slots, tokens, strict=True)]
    else:
        rows = [RowWork(s, np.asarray([t], np.int64), "draw",
                        RowDraw(float(sampled.temperature[j]), int(sampled.top_k[j]),
                                float(sampled.top_p[j]), float(sampled.u[j])))
                for j, (s, t) in enumerate(zip(slots, tokens, strict=True))]
    return np.concatenate(run_rows(runner, rows))  # (B,)


def extend(runner: ModelRunner, slot: Slot, tokens: np.ndarray, every: bool = True
           ) -> np.ndarray:
    """Tokens after one row's cache: logits (T, V), or the last's (1, V)."""
    return run_rows(runner, [RowWork(slot, np.asarray(tokens, np.int64),
                                     "every" if every else "last")])[0]


def run_rows(runner: ModelRunner, rows: Sequence[RowWork]) -> list[np.ndarray]:
    return runner.run(StepPlan(tuple(rows))).outputs
