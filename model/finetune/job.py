"""What a fine-tune gives the training loop (model/training_loop.py): the base with its
adapter (or all of it, for --full), AdamW over what trains, each step's length-grouped
micro-batches, the loss over their supervised tokens, the held-out evaluation, and the
adapter or checkpoint it writes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from model.checkpoint import (
    FINETUNE_RUN_FILE,
    METRICS_FILE,
    TOKENIZER_FILE,
    TRAIN_STATE_FILE,
    CheckpointMeta,
    carried_files,
    load_checkpoint,
    save_checkpoint,
)
from model.distributed import DistInfo
from model.finetune.batches import BatchPlan
from model.finetune.dataset import Prepared
from model.finetune.lora import LoRASettings, attach
from model.finetune.options import FinetuneOptions
from model.finetune.peft_format import adapter_files, read_adapter
from model.finetune.rehearsal import MAX_NEW_TOKENS, rehearsal_examples, rehearsal_prompts
from model.finetune.supervision import supervise
from model.finetune.tuned import TunedModel, load_base, padded
from model.staging import staged_directory
from model.train_state import load_train_state, save_train_state, train_state_bytes
from model.training_loop import Stats, Step, autocast, say


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


class FinetuneJob:
    """One fine-tune's model, optimizer, batches and outputs."""

    def __init__(self, opts: FinetuneOptions, data: Prepared, info: DistInfo,
                 device: torch.device, start: int) -> None:
        self.opts, self.data, self.info, self.device = opts, data, info, device
        self.out, self.start = Path(opts.out), start
        model, self.meta, self.held_bytes = load_base(Path(opts.ckpt), opts.full)
        self.adapter = None if opts.full else attach(
            model, LoRASettings(opts.rank, opts.alpha, opts.dropout, opts.rslora,
                                opts.target_modules), opts.seed)
        self.model = TunedModel(model, self.adapter, opts.gradient_checkpointing).to(device)
        self.trained: torch.nn.Module = self.adapter if self.adapter is not None else model
        if opts.rehearsal and data.chat:
            self._rehearse(model)
        self.params = [p for p in self.trained.parameters() if p.requires_grad]
        self.optimizer = self._optimizer()
        if opts.resume:
            self._restore()
        lengths = [len(e.ids) for e in data.train]
        self.per_epoch = math.ceil(len(lengths) / opts.batch_size)
        epochs = opts.epochs if opts.steps is None else math.ceil(
            (opts.steps + 1) * opts.accumulation * info.world_size / self.per_epoch)
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
        self.last: Evaluation | None = None  # the latest evaluation

    def _rehearse(self, model: torch.nn.Module) -> None:
        """Add the base's own answers to the general prompts to the training examples
        (model/finetune/rehearsal.py); before any step, so the adapter is still zero."""
        d = self.data
        # a question the data asks is the data's to answer
        listed = rehearsal_prompts(self.opts.rehearsal)
        prompts = [p for p in listed if p not in d.asked]
        examples, unfinished = rehearsal_examples(model, d.tokenizer, d.template, d.stop_ids,
                                                  d.eos_id, d.pad_id, prompts)
        items, _ = supervise(examples, d.tokenizer, d.template, d.stop_ids, d.eos_id,
                             d.max_length)
        d.train = d.train + items
        self.say(f"rehearsal: the base's own answers to {len(items)} of {len(prompts)} "
                 f"general prompts train beside the data ({unfinished} not finished within "
                 f"{MAX_NEW_TOKENS} tokens and {len(listed) - len(prompts)} the data "
                 "asks itself left out; --rehearsal 0: off)")

    def _optimizer(self) -> torch.optim.AdamW:
        """AdamW, fused (one kernel over every tensor: four times faster than the loop on
        a CPU at 135 M parameters; transformers' Trainer's default too); weight decay, when
        asked, on matrices only, as `attnserve train`."""
        decay = [p for p in self.params if p.dim() >= 2]
        rest = [p for p in self.params if p.dim() < 2]
        groups = ([{"params": decay, "weight_decay": self.opts.weight_decay},
                   {"params": rest, "weight_decay": 0.0}] if self.opts.weight_decay
                  else [{"params": self.params, "weight_decay": 0.0}])
        return torch.optim.AdamW([g for g in groups if g["params"]],
                                 lr=self.opts.learning_rate, betas=(0.9, 0.999), fused=True)

    def _restore(self) -> None:
        """The trained weights and AdamW's moments of the run's last save."""
        if self.adapter is not None:
            saved = read_adapter(self.out, self.meta.model)
            with torch.no_grad():
                for mine, theirs in zip(self.adapter.each(), saved.each(), strict=True):
                    mine.lora_A.copy_(theirs.lora_A)
                    mine.lora_B.copy_(theirs.lora_B)
        else:
            self.trained.load_state_dict(load_checkpoint(self.out).model.state_dict())
        if not load_train_state(self.out, self.trained, self.optimizer, self.start):
            raise ValueError(f"--resume: {self.out} holds no optimizer state of step "
                             f"{self.start}")

    def step(self, k: int) -> Step:
        """This rank's micro-batches of step k, weighed by the step's supervised tokens."""
        info, train = self.info, self.data.train
        # dropout masks of step k depend on (seed, k, rank) alone: a resumed run repeats them
        torch.manual_seed(self.opts.seed * 1_000_003 + k * info.world_size + info.rank)
        mine = self.plan.rank_share(k, info.rank)
        return Step(mine, sum(train[i].supervised_tokens for b in self.plan.step(k) for i in b),
                    sum(len(train[i].ids) for b in mine for i in b),
                    {"epoch": round(self.plan.epoch_of(k, self.per_epoch), 3)})

    def loss(self, model: torch.nn.Module, batch: list[int]) -> torch.Tensor:
        train = self.data.train
        ids, labels = padded([(train[i].ids, train[i].labels) for i in batch],
                             self.data.pad_id, self.device)
        return model(ids, labels)[0]  # Σ cross-entropy over the batch's supervised tokens

    def evaluate(self, step: int, train_loss: float | None) -> dict[str, Any] | None:
        """The held-out split's loss, perplexity and token accuracy (None without one)."""
        rows = sorted(self.data.eval, key=lambda e: len(e.ids))
        if not rows:
            return None
        self.model.eval()
        loss, hits, scored = 0.0, 0, 0
        with torch.no_grad(), autocast(self.device):
            for start in range(0, len(rows), self.opts.batch_size):
                chunk = rows[start:start + self.opts.batch_size]
                ids, labels = padded([(e.ids, e.labels) for e in chunk], self.data.pad_id,
                                     self.device)
                total, correct = self.model(ids, labels)
                loss += float(total)
                hits += int(correct)
                scored += sum(e.supervised_tokens for e in chunk)
        self.model.train()
        mean = loss / scored
        self.last = Evaluation(mean, math.exp(min(mean, 50.0)), hits / scored, scored)
        self.say(f"step {step}: {self.last.line()}" if train_loss is None else
                 f"step {step}/{self.total}: train loss {train_loss:.4f} | {self.last.line()}")
        return self.last.row()

    def save(self, step: int, metrics: list[dict[str, Any]], stats: Stats) -> None:
        """Everything of the run at ``step``: the adapter, metrics, AdamW's state and the
        run's record, replacing --out in one atomic rename; for --full the checkpoint, then
        AdamW's state beside it (as `attnserve train`: a model's moments are written from
        the tensors, not staged as 1 GB of bytes)."""
        ckpt = Path(self.opts.ckpt)
        record = {"options": self.opts.record(), "data_sha256": self.data.data_sha256,
                  "step": step, "total_steps": self.total, "checkpoint": str(ckpt.resolve()),
                  "counts": self.data.counts.summary()}
        run = (json.dumps(record, indent=2) + "\n").encode()
        if self.adapter is not None:
            files = {**adapter_files(self.adapter, str(ckpt.resolve())), FINETUNE_RUN_FILE: run,
                     TRAIN_STATE_FILE: train_state_bytes(self.trained, self.optimizer, step),
                     METRICS_FILE: "".join(json.dumps(m) + "\n" for m in metrics).encode()}
            with staged_directory(self.out) as tmp:
                for name, content in files.items():
                    (tmp / name).write_bytes(content)
            return
        training = {"finetuned_from": {"checkpoint": str(ckpt.resolve()), "step": step,
                                       "base_training": self.meta.training}}
        meta = CheckpointMeta(model=self.meta.model, tokenizer=dict(self.meta.tokenizer),
                              training=training)
        save_checkpoint(self.out, self.model.model, meta,
                        (ckpt / TOKENIZER_FILE).read_text("utf-8"), metrics,
                        extra_files={**carried_files(ckpt), FINETUNE_RUN_FILE: run})
        save_train_state(self.out, self.trained, self.optimizer, step)

    def describe(self) -> str:
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

    def say(self, message: str) -> None:
        say(message, self.info, self.opts.verbose)
