"""`attnserve finetune`: supervised fine-tuning of a checkpoint we serve, LoRA or full.

Usage:
    attnserve finetune --ckpt checkpoints/smollm2 --data chat.jsonl --out adapters/mine
    attnserve finetune --ckpt CKPT --data chat.jsonl --out adapters/mine --show-masks 3
    attnserve finetune --ckpt CKPT --data chat.jsonl --out checkpoints/mine-full --full
    torchrun --standalone --nproc_per_node 2 --no-python attnserve finetune --ckpt ...

Here the options are checked and the data read before torch is imported (a bad line is
refused at once); then model/finetune/job.py gives model/training_loop.py's loop (`attnserve
train`'s: warm-up then cosine decay, clipping at 1.0, gradient accumulation, bf16 autocast on
CUDA, DistributedDataParallel under torchrun) the model, fused AdamW (β 0.9/0.999, as
transformers' Trainer), length-grouped micro-batches (model/finetune/batches.py) and the
mean cross-entropy over a step's supervised tokens (all micro-batches, all ranks), so a
step's gradient does not depend on how its examples were split. Evaluation (loss,
perplexity, next-token accuracy on the held-out split) runs before the first step, a few
times during the run and at the end, into metrics.jsonl.

LoRA writes a PEFT adapter to --out; --full writes a checkpoint. Either is written
atomically at each evaluation with ``train_state.safetensors`` (AdamW's moments) and
``finetune.json`` (the run's options, data hash and step): ``--resume`` continues it. On
CPU a run is a function of its seed: batch k and the dropout masks of step k depend on
(seed, k) alone, so a resumed run ends where an uninterrupted one does.
"""

from __future__ import annotations

import json
import resource
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from model.checkpoint import FINETUNE_RUN_FILE as RUN_FILE
from model.checkpoint import read_metrics
from model.finetune.dataset import file_sha256, prepare
from model.finetune.options import FinetuneOptions, check_options
from model.finetune.supervision import show_masks

if TYPE_CHECKING:
    from model.finetune.job import Evaluation

EVALUATIONS = 4  # during the run, besides the one before the first step


@dataclass
class FinetuneResult:
    out: Path
    steps: int
    eval_before: Evaluation | None
    eval_after: Evaluation | None
    final_train_loss: float
    tokens_per_second: float
    wall_time_s: float
    trained_parameters: int
    held_bytes: int  # the base's weights kept as GGUF blocks
    peak_rss_bytes: int


def finetune(opts: FinetuneOptions) -> FinetuneResult | None:
    """Run one fine-tune end to end (see the module docstring); None for --show-masks."""
    check_options(opts)
    start, metrics = 0, list[dict[str, Any]]()
    if opts.resume:
        opts, start = resumed_options(opts)
        metrics = [m for m in read_metrics(opts.out) if int(m.get("step", 0)) <= start]
    prepared = prepare(opts)

    # Bad data has been refused by now; only here does torch get imported.
    from model.finetune.job import FinetuneJob
    from model.finetune.lora import targets_of
    from model.training_loop import Schedule, processes, run

    if not opts.full:
        targets_of(prepared.meta.model, opts.target_modules)  # an unknown name, before loading
    if opts.show_masks is not None:
        sys.stdout.write(show_masks(prepared.train, prepared.tokenizer, opts.show_masks,
                                    sys.stdout.isatty()) + "\n")
        return None

    with processes(opts.device) as (info, device):
        job = FinetuneJob(opts, prepared, info, device, start)
        job.say(job.describe())
        if start == 0 and (row := job.evaluate(0, None)) is not None:
            metrics.append({"step": 0, **row})
        before = job.last
        schedule = Schedule(start, job.total, opts.learning_rate, opts.warmup,
                            max(1, job.total // EVALUATIONS))
        end = run(job, schedule, info, device, metrics, opts.progress, opts.on_save, job.out)
        result = FinetuneResult(
            out=job.out, steps=job.total, eval_before=before, eval_after=job.last,
            final_train_loss=end.train_loss, tokens_per_second=end.tokens_per_s,
            wall_time_s=end.wall_s, trained_parameters=sum(p.numel() for p in job.params),
            held_bytes=job.held_bytes, peak_rss_bytes=_peak_rss())
        job.say(f"done: {job.total - start} steps in {end.wall_s:.1f} s "
                f"({end.tokens_per_s:,.0f} tokens/s), train loss {end.train_loss:.4f}"
                + (f", {job.last.line()}" if job.last else "")
                + f"; peak RSS {result.peak_rss_bytes / 2**20:,.0f} MiB -> {job.out}")
        return result


def resumed_options(opts: FinetuneOptions) -> tuple[FinetuneOptions, int]:
    """The options of the run in --out (its finetune.json), with this call's device and
    display settings, and the step it saved; the checkpoint and data must be the ones it
    started from."""
    path = Path(opts.out) / RUN_FILE
    if not path.is_file():
        raise ValueError(f"--resume: {path} is missing; {opts.out} holds no fine-tune to "
                         "continue")
    record = json.loads(path.read_text("utf-8"))
    saved = dict(record["options"])
    saved.pop("learning_rate", None)
    saved["target_modules"] = tuple(saved["target_modules"])
    if Path(saved["ckpt"]).resolve() != Path(opts.ckpt).resolve():
        raise ValueError(f"--resume: the run in {opts.out} fine-tunes {saved['ckpt']}, not "
                         f"{opts.ckpt}")
    data = file_sha256(opts.data, saved.get("eval_data"))
    if data != record["data_sha256"]:
        raise ValueError(f"--resume: {opts.data} is not the data the run in {opts.out} "
                         "started with (its sha256 differs)")
    keep = ("ckpt", "data", "out")
    return (replace(opts, **{k: v for k, v in saved.items() if k not in keep}),
            int(record.get("step", 0)))


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
