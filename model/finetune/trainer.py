"""`attnserve finetune`: supervised fine-tuning of a checkpoint we serve, LoRA or full.

Usage:
    attnserve finetune --ckpt checkpoints/smollm2 --data chat.jsonl --out adapters/mine
    attnserve finetune --ckpt CKPT --data chat.jsonl --out adapters/mine --show-masks 3
    attnserve finetune --ckpt CKPT --data chat.jsonl --out checkpoints/mine-full --full
    torchrun --standalone --nproc_per_node 2 --no-python attnserve finetune --ckpt ...

AdamW (fused, β 0.9/0.999: transformers' Trainer's), gradient-norm clipping at 1.0,
warm-up then cosine decay to 10% of the peak (``attnserve train``'s schedule), gradient
accumulation, length-grouped micro-batches (model/finetune/batches.py), optional gradient
checkpointing, bf16 autocast on CUDA, DistributedDataParallel under torchrun. The loss is the mean
cross-entropy over an optimizer step's supervised tokens (all micro-batches, all ranks),
so a step's gradient does not depend on how its examples were split. Evaluation (loss,
perplexity, next-token accuracy on the held-out split) runs before the first step, a few
times during the run and at the end, into metrics.jsonl.

LoRA writes a PEFT adapter to --out; --full writes a checkpoint. Either is written
atomically at each evaluation with ``train_state.safetensors`` (AdamW's moments) and
``finetune.json`` (the run's options, data hash and step): ``--resume`` continues it. On
CPU a run is a function of its seed: batch k and the dropout masks of step k depend on
(seed, k) alone, so a resumed run ends where an uninterrupted one does.
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from model.checkpoint import FINETUNE_RUN_FILE as RUN_FILE
from model.checkpoint import METRICS_FILE, TOKENIZER_FILE, TRAIN_STATE_FILE
from model.finetune.dataset import Prepared, prepare
from model.finetune.options import FinetuneOptions, check_options
from model.finetune.supervision import show_masks

if TYPE_CHECKING:
    import torch

    from model.distributed import DistInfo
    from model.finetune.tuned import TunedModel

EVALUATIONS = 4  # during the run, besides the one before the first step


@dataclass(frozen=True)
class Evaluation:
    """Mean cross-entropy (nats) of the held-out split's supervised tokens, its
    perplexity, and how often the most likely next token was the right one."""

    loss: float
    perplexity: float
    token_accuracy: float
    tokens: int

    def row(self) -> dict[str, float | int]:
        return {"eval_loss": self.loss, "eval_perplexity": self.perplexity,
                "eval_token_accuracy": self.token_accuracy, "eval_tokens": self.tokens}

    def line(self) -> str:
        return (f"eval loss {self.loss:.4f} (perplexity {self.perplexity:.2f}, token accuracy "
                f"{100 * self.token_accuracy:.1f}% of {self.tokens})")


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
    if opts.resume:
        opts = resumed_options(opts)
    prepared = prepare(opts)
    if not opts.full:
        from model.finetune.lora import targets_of

        targets_of(prepared.meta.model, opts.target_modules)  # an unknown name, before loading
    if opts.show_masks is not None:
        color = sys.stdout.isatty()
        sys.stdout.write(show_masks(prepared.train, prepared.tokenizer, opts.show_masks,
                                    color) + "\n")
        return None

    import torch  # only now: bad input has been refused

    from model import distributed as dist_utils
    from model.train import pick_device

    info = dist_utils.env_info()
    device = pick_device(opts.device, info)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist_utils.init(info, device)
    try:
        return _Run(opts, prepared, info, device).train()
    finally:
        dist_utils.shutdown()


def resumed_options(opts: FinetuneOptions) -> FinetuneOptions:
    """The options of the run in --out (its finetune.json), with this call's device and
    display settings; the checkpoint and data must be the ones it started from."""
    from model.finetune.dataset import file_sha256

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
    return replace(opts, **{k: v for k, v in saved.items() if k not in keep})


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


class _Run:
    """One fine-tune's state: model, optimizer, batches, metrics."""

    def __init__(self, opts: FinetuneOptions, data: Prepared, info: DistInfo,
                 device: torch.device) -> None:

        from model.finetune.batches import BatchPlan
        from model.finetune.lora import LoRASettings, attach
        from model.finetune.tuned import TunedModel, load_base

        self.opts, self.data, self.info, self.device = opts, data, info, device
        self.out = Path(opts.out)
        self.record = self._read_record() if opts.resume else {}
        self.start = int(self.record.get("step", 0))
        model, self.meta, self.held_bytes = load_base(Path(opts.ckpt), opts.full)
        self.adapter = None
        if not opts.full:
            self.settings = LoRASettings(opts.rank, opts.alpha, opts.dropout, opts.rslora,
                                         opts.target_modules)
            self.adapter = attach(model, self.settings, opts.seed)
        self.tuned: TunedModel = TunedModel(model, self.adapter,
                                            opts.gradient_checkpointing).to(device)
        self.trained: torch.nn.Module = self.adapter if self.adapter is not None else model
        if opts.rehearsal and data.chat:
            self._rehearse(model)
        self.params = [p for p in self.trained.parameters() if p.requires_grad]
        self.optimizer = self._optimizer()
        if opts.resume:
            self._restore()
        self.wrapped: torch.nn.Module = self.tuned
        if info.enabled:
            from torch.nn.parallel import DistributedDataParallel

            self.wrapped = DistributedDataParallel(
                self.tuned, device_ids=[device.index] if device.type == "cuda" else None)
        lengths = [len(e.ids) for e in data.train]
        per_epoch = math.ceil(len(lengths) / opts.batch_size)
        epochs = opts.epochs if opts.steps is None else math.ceil(
            (opts.steps + 1) * opts.accumulation * info.world_size / per_epoch)
        self.plan = BatchPlan.build(lengths, opts.batch_size, epochs, opts.seed,
                                    opts.accumulation, info.world_size)
        self.total = opts.steps if opts.steps is not None else self.plan.steps
        if self.total <= 0:
            raise ValueError(f"{len(lengths)} training examples make no whole optimizer step "
                             f"of {opts.batch_size} × {opts.accumulation} × "
                             f"{info.world_size} examples; lower --batch-size or "
                             "--accumulation")
        if self.start >= self.total:
            raise ValueError(f"--resume: the run in {self.out} is done ({self.start} of "
                             f"{self.total} steps)")
        self.metrics: list[dict[str, Any]] = [
            m for m in self.record.get("metrics", []) if int(m.get("step", 0)) <= self.start]

    # -- setup ---------------------------------------------------------------------------
    def _rehearse(self, model: torch.nn.Module) -> None:
        """Add the base's own answers to the general prompts to the training examples
        (model/finetune/rehearsal.py); before any step, so the adapter is still zero."""
        from model.finetune.rehearsal import (
            MAX_NEW_TOKENS,
            rehearsal_examples,
            rehearsal_prompts,
        )
        from model.finetune.supervision import supervise

        d = self.data
        # a question the data asks is the data's to answer
        listed = rehearsal_prompts(self.opts.rehearsal)
        prompts = [p for p in listed if p not in d.asked]
        examples, unfinished = rehearsal_examples(model, d.tokenizer, d.template, d.stop_ids,
                                                  d.eos_id, d.pad_id, prompts)
        items, _ = supervise(examples, d.tokenizer, d.template, d.stop_ids, d.eos_id,
                             d.max_length)
        d.train = d.train + items
        self._say(f"rehearsal: the base's own answers to {len(items)} of {len(prompts)} "
                  f"general prompts train beside the data ({unfinished} not finished within "
                  f"{MAX_NEW_TOKENS} tokens and {len(listed) - len(prompts)} the data "
                  "asks itself left out; --rehearsal 0: off)")

    def _optimizer(self) -> torch.optim.AdamW:
        """AdamW, fused (one kernel over every tensor: four times faster than the loop on
        a CPU at 135 M parameters; transformers' Trainer's default too); weight decay, when
        asked, on matrices only, as `attnserve train`."""
        import torch

        decay = [p for p in self.params if p.dim() >= 2]
        rest = [p for p in self.params if p.dim() < 2]
        groups = ([{"params": decay, "weight_decay": self.opts.weight_decay},
                   {"params": rest, "weight_decay": 0.0}] if self.opts.weight_decay
                  else [{"params": self.params, "weight_decay": 0.0}])
        return torch.optim.AdamW([g for g in groups if g["params"]],
                                 lr=self.opts.learning_rate, betas=(0.9, 0.999), fused=True)

    def _read_record(self) -> dict[str, Any]:
        from model.checkpoint import read_metrics

        record: dict[str, Any] = json.loads((self.out / RUN_FILE).read_text("utf-8"))
        record["metrics"] = read_metrics(self.out)
        return record

    def _restore(self) -> None:
        """The trained weights and AdamW's moments of the run's last save."""
        import torch

        from model.train_state import load_train_state

        if self.adapter is not None:
            from model.finetune.peft_format import read_adapter

            saved = read_adapter(self.out, self.meta.model)
            with torch.no_grad():
                for mine, theirs in zip(self.adapter.each(), saved.each(), strict=True):
                    mine.lora_A.copy_(theirs.lora_A)
                    mine.lora_B.copy_(theirs.lora_B)
        else:
            from model.checkpoint import load_checkpoint

            self.trained.load_state_dict(load_checkpoint(self.out).model.state_dict())
        if not load_train_state(self.out, self.trained, self.optimizer, self.start):
            raise ValueError(f"--resume: {self.out} holds no optimizer state of step "
                             f"{self.start}")

    # -- the loop ------------------------------------------------------------------------
    def train(self) -> FinetuneResult:
        from tqdm import tqdm

        from model import distributed as dist_utils
        from model.train import lr_at

        opts, info = self.opts, self.info
        self._say(self._describe())
        before = self.evaluate() if self.start == 0 else None
        if before is not None:
            self._say(f"step 0: {before.line()}")
            self.metrics.append({"step": 0, **before.row()})
        every = max(1, self.total // EVALUATIONS)
        bar = tqdm(total=self.total, initial=self.start, unit="step", dynamic_ncols=True,
                   disable=not (opts.progress and info.is_main and sys.stderr.isatty()))
        t0, seconds, tokens = time.perf_counter(), 0.0, 0.0
        recent: list[float] = []
        after: Evaluation | None = None
        for step in range(self.start, self.total):
            lr = lr_at(step / self.total, opts.learning_rate, opts.warmup)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            started = time.perf_counter()
            loss, step_tokens = self._step(step)
            seconds += time.perf_counter() - started
            tokens += dist_utils.sum_across([float(step_tokens)], info, self.device)[0]
            recent = [*recent[-9:], loss]
            tok_s = tokens / max(seconds, 1e-9)
            row: dict[str, Any] = {"step": step + 1, "train_loss": loss, "lr": lr,
                                   "tokens_per_s": tok_s,
                                   "epoch": round(self.plan.epoch_of(step, self._per_epoch()),
                                                  3),
                                   "elapsed_s": time.perf_counter() - t0}
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}")
            last = step + 1 == self.total
            if (step + 1) % every == 0 or last:
                after = self.evaluate()
                if after is not None:
                    row |= after.row()
                    self._say(f"step {step + 1}/{self.total}: train loss {loss:.4f} | "
                              f"{after.line()}")
            self.metrics.append(row)
            if info.is_main and ((step + 1) % every == 0 or last):
                self._save(step + 1)
                if opts.on_save is not None:
                    opts.on_save(step + 1, self.out)
        bar.close()
        wall = time.perf_counter() - t0
        tok_s = tokens / max(seconds, 1e-9)
        result = FinetuneResult(
            out=self.out, steps=self.total, eval_before=before, eval_after=after,
            final_train_loss=sum(recent) / len(recent) if recent else math.nan,
            tokens_per_second=tok_s, wall_time_s=wall,
            trained_parameters=sum(p.numel() for p in self.params),
            held_bytes=self.held_bytes, peak_rss_bytes=_peak_rss())
        self._say(f"done: {self.total - self.start} steps in {wall:.1f} s ({tok_s:,.0f} "
                  f"tokens/s), train loss {result.final_train_loss:.4f}"
                  + (f", {after.line()}" if after else "")
                  + f"; peak RSS {result.peak_rss_bytes / 2**20:,.0f} MiB -> {self.out}")
        return result

    def _per_epoch(self) -> int:
        return math.ceil(len(self.data.train) / self.opts.batch_size)

    def _step(self, step: int) -> tuple[float, int]:
        """One optimizer step: (its mean loss over all ranks, tokens this rank fed)."""
        import torch

        from model import distributed as dist_utils
        from model.finetune.tuned import padded

        info, train = self.info, self.data.train
        # dropout masks of step k depend on (seed, k, rank) alone: a resumed run repeats them
        torch.manual_seed(self.opts.seed * 1_000_003 + step * info.world_size + info.rank)
        scored = sum(train[i].supervised_tokens for batch in self.plan.step(step)
                     for i in batch)
        mine = self.plan.rank_share(step, info.rank)
        loss_sum, tokens = 0.0, 0
        self.tuned.train()
        for j, batch in enumerate(mine):
            ids, labels = padded([(train[i].ids, train[i].labels) for i in batch],
                                 self.data.pad_id, self.device)
            syncing = j == len(mine) - 1 or not self.info.enabled
            with (contextlib.nullcontext() if syncing
                  else self.wrapped.no_sync()):  # type: ignore[operator]
                with self._autocast():
                    total, _ = self.wrapped(ids, labels)
                (total * (info.world_size / scored)).backward()
            loss_sum += float(total.detach())
            tokens += sum(len(train[i].ids) for i in batch)
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        (loss_sum,) = dist_utils.sum_across([loss_sum], info, self.device)
        return loss_sum / scored, tokens

    def _autocast(self) -> Any:
        import torch

        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def evaluate(self) -> Evaluation | None:
        """The held-out split's loss, perplexity and token accuracy (None without one)."""
        import torch

        from model.finetune.tuned import padded

        rows = sorted(self.data.eval, key=lambda e: len(e.ids))
        if not rows:
            return None
        self.tuned.eval()
        loss, hits, scored = 0.0, 0, 0
        with torch.no_grad(), self._autocast():
            for start in range(0, len(rows), self.opts.batch_size):
                chunk = rows[start:start + self.opts.batch_size]
                ids, labels = padded([(e.ids, e.labels) for e in chunk], self.data.pad_id,
                                     self.device)
                total, correct = self.tuned(ids, labels)
                loss += float(total)
                hits += int(correct)
                scored += sum(e.supervised_tokens for e in chunk)
        self.tuned.train()
        mean = loss / scored
        return Evaluation(mean, math.exp(min(mean, 50.0)), hits / scored, scored)

    # -- output --------------------------------------------------------------------------
    def _save(self, step: int) -> None:
        """Everything of the run at ``step``: the adapter, metrics, AdamW's state and the
        run's record, replacing --out in one atomic rename; for --full the checkpoint, then
        AdamW's state beside it (as `attnserve train`: a model's moments are written from
        the tensors, not staged as 1 GB of bytes)."""
        from model.checkpoint import CheckpointMeta, carried_files, save_checkpoint
        from model.staging import staged_directory
        from model.train_state import save_train_state, train_state_bytes

        ckpt = Path(self.opts.ckpt)
        record = {"options": self.opts.record(), "data_sha256": self.data.data_sha256,
                  "step": step, "total_steps": self.total, "checkpoint": str(ckpt.resolve()),
                  "counts": self.data.counts.summary()}
        run = (json.dumps(record, indent=2) + "\n").encode()
        if self.adapter is not None:
            from model.finetune.peft_format import adapter_files

            with staged_directory(self.out) as tmp:
                files = {**adapter_files(self.adapter, str(ckpt.resolve())), RUN_FILE: run,
                         TRAIN_STATE_FILE: train_state_bytes(self.trained, self.optimizer,
                                                             step)}
                for name, content in files.items():
                    (tmp / name).write_bytes(content)
                (tmp / METRICS_FILE).write_text(
                    "".join(json.dumps(m) + "\n" for m in self.metrics), encoding="utf-8")
            return
        training = {"finetuned_from": {"checkpoint": str(ckpt.resolve()), "step": step,
                                       "base_training": self.meta.training}}
        meta = CheckpointMeta(model=self.meta.model, tokenizer=dict(self.meta.tokenizer),
                              training=training)
        save_checkpoint(self.out, self.tuned.model, meta,
                        (ckpt / TOKENIZER_FILE).read_text("utf-8"), self.metrics,
                        extra_files={**carried_files(ckpt), RUN_FILE: run})
        save_train_state(self.out, self.trained, self.optimizer, step)

    def _describe(self) -> str:
        opts, data = self.opts, self.data
        what = ("full fine-tune" if opts.full else
                f"LoRA r {opts.rank}, alpha {opts.alpha:g}{' (rsLoRA)' if opts.rslora else ''}, "
                f"dropout {opts.dropout:g} on {len(self.adapter.loras) if self.adapter else 0} "
                "modules")
        held = (f", base held as GGUF blocks ({self.held_bytes / 2**20:,.0f} MiB)"
                if self.held_bytes else "")
        return (f"{what}: {sum(p.numel() for p in self.params):,} trained parameters{held}; "
                f"{len(data.train)} training / {len(data.eval)} held-out examples "
                f"({data.counts.summary()}); {self.total} steps of {opts.batch_size} × "
                f"{opts.accumulation} × {self.info.world_size} examples, lr "
                f"{opts.learning_rate:g}, on {self.device.type}")

    def _say(self, message: str) -> None:
        if self.opts.verbose and self.info.is_main:
            from tqdm import tqdm

            tqdm.write(message, file=sys.stdout)
            sys.stdout.flush()

