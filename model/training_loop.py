"""The training loop `attnserve train` and `attnserve finetune` share.

A `Job` supplies its model, trained parameters and optimizer, each step's micro-batches and
their loss, its evaluation and its outputs. The loop owns the rest: the device and torchrun's
process group, DistributedDataParallel, gradient accumulation, a linear warm-up then a cosine
decay to 10% of the peak learning rate, gradient-norm clipping at 1.0, bf16 autocast on CUDA,
the progress bar, the recent-loss window, the metrics.jsonl rows, and evaluation and saving
every ``eval_every`` steps and at the end. A step's loss is the sum of the job's over its
micro-batches on every rank divided by the step's ``scored`` weight (its supervised tokens,
or one per rank for a mean), so its gradient does not depend on how the examples were split.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from model import distributed as dist_utils
from model.distributed import DistInfo

MIN_LR_RATIO = 0.1
RECENT = 10  # steps whose mean train loss is the run's final one


def lr_at(progress: float, peak: float, warmup: float) -> float:
    """Linear warm-up over the first ``warmup`` fraction, then cosine down to 10% of peak."""
    if progress < warmup:
        return peak * (progress + 1e-3) / warmup
    decay = min(1.0, (progress - warmup) / max(1e-9, 1.0 - warmup))
    return peak * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * decay)))


def autocast(device: torch.device) -> Any:
    """bf16 autocast on CUDA; float32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def say(message: str, info: DistInfo, verbose: bool) -> None:
    """A line on rank 0's stdout, written above the progress bar rather than through it."""
    if verbose and info.is_main:
        tqdm.write(message, file=sys.stdout)
        sys.stdout.flush()


@contextlib.contextmanager
def processes(requested_device: str, tf32: bool = False) -> Iterator[tuple[DistInfo, torch.device]]:
    """This process's rank and device, in torchrun's process group when launched by it."""
    info = dist_utils.env_info()
    if requested_device == "auto":
        requested_device = "cuda" if torch.cuda.is_available() else "cpu"
    device = (torch.device("cuda", info.local_rank) if requested_device == "cuda" and info.enabled
              else torch.device(requested_device))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if tf32:
            torch.backends.cuda.matmul.allow_tf32 = True
    dist_utils.init(info, device)
    try:
        yield info, device
    finally:
        dist_utils.shutdown()


@dataclass
class Step:
    """One optimizer step's work on this rank."""

    batches: list[Any]  # this rank's micro-batches, each given to Job.loss
    scored: float  # the whole step's weight, all ranks together: the loss is divided by it
    tokens: int  # tokens this rank feeds
    row: dict[str, Any] = field(default_factory=dict)  # extra metrics.jsonl fields


@dataclass(frozen=True)
class Stats:
    """Where a run stands: steps done, mean train loss of the recent steps, throughput."""

    step: int
    train_loss: float
    tokens_per_s: float
    wall_s: float


class Job(Protocol):
    """What a run supplies (model/train.py's _GPTJob, model/finetune/job.py's FinetuneJob).
    ``loss``: one micro-batch's through ``model`` (DistributedDataParallel's wrapper under
    torchrun), summed over what Step.scored counts; ``evaluate``: evaluate, say so, and
    return the metrics fields (None: nothing to evaluate on)."""

    @property
    def model(self) -> nn.Module: ...

    @property
    def params(self) -> list[nn.Parameter]: ...  # the trained ones: clipped, stepped

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    def step(self, k: int) -> Step: ...

    def loss(self, model: nn.Module, batch: Any) -> Tensor: ...

    def evaluate(self, step: int, train_loss: float | None) -> dict[str, Any] | None: ...

    def save(self, step: int, metrics: list[dict[str, Any]], stats: Stats) -> None: ...


@dataclass(frozen=True)
class Schedule:
    start: int  # steps a resumed run has done already
    total: int | None  # None: until the time budget is spent
    peak_lr: float
    warmup: float  # fraction of the run the learning rate warms up over
    eval_every: int
    time_budget: float | None = None  # seconds; the run stops at whichever limit comes first


def run(job: Job, schedule: Schedule, info: DistInfo, device: torch.device,
        metrics: list[dict[str, Any]], progress_bar: bool,
        on_save: Callable[[int, Path], None] | None, out: Path) -> Stats:
    """Train from ``schedule.start`` to the end, appending a row per step to ``metrics``;
    rank 0 saves at every evaluation and at the end (then calls ``on_save``)."""
    s = schedule
    wrapped: nn.Module = job.model
    if info.enabled:
        wrapped = DistributedDataParallel(
            job.model, device_ids=[device.index] if device.type == "cuda" else None)
    bar = tqdm(total=s.total, initial=s.start, unit="step", dynamic_ncols=True,
               disable=not (progress_bar and info.is_main and sys.stderr.isatty()))
    t0 = time.perf_counter()
    step, evaluated, recent, seconds, tokens = s.start, s.start, list[float](), 0.0, 0.0

    def stats() -> Stats:
        return Stats(step, sum(recent) / len(recent) if recent else math.nan,
                     tokens / max(seconds, 1e-9), time.perf_counter() - t0)

    def save() -> None:
        job.save(step, metrics, stats())
        if on_save is not None:
            on_save(step, out)

    while True:
        progress = step / s.total if s.total else 0.0
        if s.time_budget is not None:
            # Rank 0's clock decides: every rank takes the same learning rate and stops together
            elapsed = time.perf_counter() - t0 if info.is_main else 0.0
            progress = max(progress, dist_utils.sum_across([elapsed], info, device)[0]
                           / s.time_budget)
        if progress >= 1.0:
            break
        lr = lr_at(progress, s.peak_lr, s.warmup)
        for group in job.optimizer.param_groups:
            group["lr"] = lr
        started = time.perf_counter()
        work = job.step(step)
        loss, fed = _optimizer_step(job, wrapped, work, info, device)
        seconds += time.perf_counter() - started
        tokens += fed
        step += 1
        recent = [*recent[-(RECENT - 1):], loss]
        tok_s = tokens / max(seconds, 1e-9)
        row = {"step": step, "train_loss": loss, "lr": lr, "tokens_per_s": tok_s, **work.row,
               "elapsed_s": time.perf_counter() - t0}
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}")
        last = s.total is not None and step >= s.total
        if step % s.eval_every == 0 or last:
            row |= job.evaluate(step, loss) or {}
            evaluated = step
        metrics.append(row)
        if info.is_main and step % s.eval_every == 0 and not last:
            save()
    bar.close()
    if evaluated != step:  # stopped by the time budget
        metrics[-1] |= job.evaluate(step, recent[-1]) or {}
    end = stats()
    if info.is_main:
        save()
    return end


def _optimizer_step(job: Job, wrapped: nn.Module, work: Step, info: DistInfo,
                    device: torch.device) -> tuple[float, float]:
    """(the step's loss over all ranks, tokens all ranks fed)."""
    job.model.train()
    loss_sum = 0.0
    for j, batch in enumerate(work.batches):
        # DistributedDataParallel averages the gradients once, after the last micro-batch
        syncing = j == len(work.batches) - 1 or not info.enabled
        with contextlib.nullcontext() if syncing else wrapped.no_sync():  # type: ignore[operator]
            with autocast(device):
                loss = job.loss(wrapped, batch)
            (loss * (info.world_size / work.scored)).backward()
        loss_sum += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(job.params, 1.0)
    job.optimizer.step()
    job.optimizer.zero_grad(set_to_none=True)
    loss_sum, tokens = dist_utils.sum_across([loss_sum, float(work.tokens)], info, device)
    return loss_sum / work.scored, tokens
