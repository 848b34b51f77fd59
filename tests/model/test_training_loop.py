"""The shared training loop (model/training_loop.py) on a toy job: a float64 linear model
fitting fixed examples with a summed squared error, so every number is checkable by hand."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from model.distributed import DistInfo
from model.training_loop import Schedule, Stats, Step, run

CPU = torch.device("cpu")


class ToyJob:
    """Step k fits examples 8k..8k+7 of a fixed set, split into ``splits`` micro-batches."""

    def __init__(self, splits: int) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(4, 1).double()
        self.params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=0.1)
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(64, 4, generator=g, dtype=torch.float64)
        self.y = torch.randn(64, 1, generator=g, dtype=torch.float64)
        self.splits = splits
        self.evaluated: list[tuple[int, float | None]] = []
        self.saved: list[tuple[int, int]] = []  # (step, rows of metrics then)

    def step(self, k: int) -> Step:
        rows = list(range(8 * k, 8 * k + 8))
        size = 8 // self.splits
        return Step([rows[i:i + size] for i in range(0, 8, size)], 8, 8 * 4, {"k": k})

    def loss(self, model: nn.Module, batch: list[int]) -> Tensor:
        return ((model(self.x[batch]) - self.y[batch]) ** 2).sum()

    def evaluate(self, step: int, train_loss: float | None) -> dict[str, Any]:
        self.evaluated.append((step, train_loss))
        return {"eval_step": step}

    def save(self, step: int, metrics: list[dict[str, Any]], stats: Stats) -> None:
        self.saved.append((step, len(metrics)))


def _run(job: ToyJob, total: int = 7, eval_every: int = 3, start: int = 0,
         warmup: float = 0.5) -> tuple[list[dict[str, Any]], Stats, list[int]]:
    metrics: list[dict[str, Any]] = []
    called: list[int] = []
    end = run(job, Schedule(start, total, 0.1, warmup, eval_every), DistInfo(), CPU, metrics,
              False, lambda step, _out: called.append(step), Path("unused"))
    return metrics, end, called


@pytest.mark.parametrize("splits", [2, 4, 8])
def test_a_steps_gradient_does_not_depend_on_its_micro_batches(splits: int) -> None:
    whole, parts = ToyJob(1), ToyJob(splits)
    rows_whole, end_whole, _ = _run(whole)
    rows_parts, end_parts, _ = _run(parts)
    for a, b in zip(whole.params, parts.params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for row_whole, row_parts in zip(rows_whole, rows_parts, strict=True):
        assert row_whole["train_loss"] == pytest.approx(row_parts["train_loss"], rel=1e-12)
    assert end_whole.train_loss == pytest.approx(end_parts.train_loss, rel=1e-12)


def test_schedule_rows_evaluations_and_saves() -> None:
    job = ToyJob(2)
    rows, end, on_save = _run(job, total=4, eval_every=3)
    # warm-up over the first half, then cosine from the peak (0.1) down to 10% of it
    expected = [0.1 * 0.001 / 0.5, 0.1 * 0.251 / 0.5, 0.1,
                0.1 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))]
    assert [r["lr"] for r in rows] == pytest.approx(expected)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["k"] for r in rows] == [0, 1, 2, 3]  # the job's own fields ride along
    assert [r.get("eval_step") for r in rows] == [None, None, 3, 4]
    assert [s for s, _ in job.evaluated] == [3, 4]
    assert job.evaluated[-1][1] == rows[-1]["train_loss"]
    assert job.saved == [(3, 3), (4, 4)] and on_save == [3, 4]  # the last step saved once
    assert end.step == 4
    assert end.train_loss == pytest.approx(sum(r["train_loss"] for r in rows) / 4)


def test_a_resumed_run_continues_the_schedule() -> None:
    straight, resumed = ToyJob(1), ToyJob(1)
    rows, _, _ = _run(straight, total=6)
    for k in range(3):  # the first half by hand: AdamW at the rows' learning rates
        for g in resumed.optimizer.param_groups:
            g["lr"] = rows[k]["lr"]
        (resumed.loss(resumed.model, list(range(8 * k, 8 * k + 8))) / 8).backward()
        torch.nn.utils.clip_grad_norm_(resumed.params, 1.0)
        resumed.optimizer.step()
        resumed.optimizer.zero_grad()
    rest, end, _ = _run(resumed, total=6, start=3)
    assert [r["step"] for r in rest] == [4, 5, 6]
    assert [r["lr"] for r in rest] == [r["lr"] for r in rows[3:]]
    for a, b in zip(straight.params, resumed.params, strict=True):
        assert torch.equal(a, b)
    assert end.step == 6
