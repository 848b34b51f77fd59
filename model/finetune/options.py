"""Everything `attnserve finetune` accepts, its defaults, and the checks made before any
data is read or torch is imported.

The defaults are the usual LoRA ones (r 16, alpha 32, dropout 0.05 on every projection),
sized so that about fifty chat examples teach SmolLM2-135M new facts in a few minutes on
two CPU cores (docs/training.md#fine-tuning shows the run they were chosen on).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

# The defaults that differ between LoRA and a full fine-tune: a LoRA update starts at zero
# and trains few weights, so it takes a learning rate about ten times a full fine-tune's.
LORA_LR = 1e-3
FULL_LR = 1e-5
MIN_EVAL_EXAMPLES = 20  # below this, --eval-fraction's default holds nothing out


@dataclass
class FinetuneOptions:
    """``None`` means: derived (see each field)."""

    ckpt: str
    data: str
    out: str
    eval_data: str | None = None
    eval_fraction: float | None = None  # None: 10% with MIN_EVAL_EXAMPLES or more, else 0
    full: bool = False
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    rslora: bool = False
    target_modules: tuple[str, ...] = ()  # () = every projection the family has
    epochs: int = 6
    steps: int | None = None  # None: epochs' worth
    lr: float | None = None  # None: LORA_LR or FULL_LR
    warmup: float = 0.05  # fraction of the steps, as `attnserve train`
    weight_decay: float = 0.0
    batch_size: int = 8  # examples per micro-batch and process
    accumulation: int = 1  # micro-batches per optimizer step
    max_length: int = 1024  # tokens an example may have (capped by the model's context)
    gradient_checkpointing: bool = False
    rehearsal: int = 48  # general prompts whose base answers train beside chat data; 0: off
    seed: int = 0
    device: str = "auto"
    resume: bool = False
    force: bool = False
    show_masks: int | None = None
    progress: bool = True
    verbose: bool = True
    on_save: Callable[[int, Path], None] | None = None  # after each save (rank 0): step, out

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else (FULL_LR if self.full else LORA_LR)

    def record(self) -> dict[str, Any]:
        """The options that define the run (what --resume must find unchanged)."""
        skip = {"resume", "force", "show_masks", "progress", "verbose", "device", "on_save"}
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        out["target_modules"] = list(self.target_modules)
        out["learning_rate"] = self.learning_rate
        return out


def check_options(opts: FinetuneOptions) -> None:
    """Reject bad values with one line each, before any file is read."""
    positive = {"rank": opts.rank, "epochs": opts.epochs, "batch_size": opts.batch_size,
                "accumulation": opts.accumulation, "max_length": opts.max_length}
    for name, value in positive.items():
        if value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if opts.rehearsal < 0:
        raise ValueError(f"--rehearsal must be 0 (off) or more, got {opts.rehearsal}")
    if opts.steps is not None and opts.steps <= 0:
        raise ValueError(f"--steps must be positive, got {opts.steps}")
    if opts.lr is not None and not opts.lr > 0:
        raise ValueError(f"--lr must be positive, got {opts.lr}")
    if not opts.alpha > 0:
        raise ValueError(f"--lora-alpha must be positive, got {opts.alpha}")
    if not 0.0 <= opts.dropout < 1.0:
        raise ValueError(f"--lora-dropout must be in [0, 1), got {opts.dropout}")
    if not 0.0 <= opts.warmup < 1.0:
        raise ValueError(f"--warmup must be in [0, 1), got {opts.warmup}")
    if opts.weight_decay < 0:
        raise ValueError(f"--weight-decay must be >= 0, got {opts.weight_decay}")
    if opts.eval_fraction is not None and not 0.0 <= opts.eval_fraction < 1.0:
        raise ValueError(f"--eval-fraction must be in [0, 1), got {opts.eval_fraction}")
    if opts.eval_data is not None and opts.eval_fraction:
        raise ValueError("--eval-data and --eval-fraction exclude each other")
    if opts.show_masks is not None and opts.show_masks <= 0:
        raise ValueError(f"--show-masks must be positive, got {opts.show_masks}")
    if opts.device not in ("auto", "cpu", "cuda") and not opts.device.startswith("cuda:"):
        raise ValueError(f"unknown device {opts.device!r}; choose auto, cpu or cuda")
    if opts.resume and opts.force:
        raise ValueError("--resume continues the run in --out; --force would replace it")
    for name in ("data", "eval_data"):
        value = getattr(opts, name)
        if value is not None and not Path(value).is_file():
            raise ValueError(f"--{name.replace('_', '-')} {value} is not a file")
    if opts.show_masks is None:
        check_output(Path(opts.out), opts.resume, opts.force)


def check_output(out: Path, resume: bool, force: bool) -> None:
    """A new run writes to an absent or empty directory (or replaces one with --force):
    an earlier run's adapter is never lost by accident."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out} exists and is not a directory")
    if resume:
        if not out.is_dir():
            raise ValueError(f"--resume: {out} holds no run to continue")
        return
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"output directory {out} is not empty; pass --force to replace it "
                         "or --resume to continue its run")

