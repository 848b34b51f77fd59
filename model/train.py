"""Train a GPT on a text corpus and write a checkpoint directory.

Usage:
    attnserve train --data stdlib --preset small --out checkpoints/default
    attnserve train --data notes.txt --preset tiny --out /tmp/ckpt --steps 200 --tokenizer char
    torchrun --standalone --nproc_per_node 2 --no-python attnserve train --preset tiny --out ck

AdamW on the cross-entropy of random windows (seed 003's clipping at 1.0), validation loss
and perplexity beside a unigram baseline; the loop (warm-up then cosine decay, bf16 autocast
on CUDA, DistributedDataParallel under torchrun, rank 0 writing the checkpoint) is
model/training_loop.py's. On CPU a run is a deterministic function of its seed.
``--resume`` continues the checkpoint in ``--out``: weights, AdamW moments
(train_state.safetensors) and the step count; ``--steps`` is then the total, and since the
learning rate depends on step/total and batch ``k`` on (seed, rank, k) alone, a resumed run
ends bit-identical to one that was never interrupted.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_model
from tokenizers import Tokenizer
from torch import Tensor, nn

from model import distributed as dist_utils
from model.architectures import architecture, architecture_names
from model.checkpoint import (
    Checkpoint,
    CheckpointMeta,
    load_checkpoint,
    read_meta,
    read_metrics,
    save_checkpoint,
)
from model.config import PRESETS, config_from_preset
from model.data import (
    DOC_SEPARATOR,
    BatchSampler,
    TokenSplits,
    encode_documents,
    eval_windows,
    read_documents,
    resolve_data_path,
    split_stream,
    unigram_cross_entropy,
)
from model.distributed import DistInfo
from model.gpt import GPT
from model.tokenizer import build_tokenizer, checkpoint_special_ids, special_ids
from model.train_state import load_train_state, make_optimizer, save_train_state
from model.training_loop import Schedule, Stats, Step, autocast, processes, run, say

WARMUP = 0.05  # fraction of the run


@dataclass
class TrainOptions:
    """Everything `attnserve train` accepts.

    ``None`` means: the checkpoint's own value when resuming, else the preset's (preset
    ``small``, seed 0).
    """

    out: str
    data: str = "stdlib"
    preset: str | None = None
    steps: int | None = None
    time_budget: float | None = None  # seconds; training stops at whichever limit comes first
    seed: int | None = None
    device: str = "auto"
    resume: bool = False
    tokenizer: Literal["char", "bpe"] = "bpe"
    vocab_size: int | None = None
    # None: the architecture's own (GPT: learned positions, ReLU; llama: rotary, SwiGLU).
    position: Literal["learned", "sinusoidal"] | None = None
    activation: str | None = None  # one of the architecture's (gpt: relu, gelu, gelu_tanh)
    arch: str | None = None  # None: the preset's
    tie_weights: bool = False
    attn_bias: bool = False  # biases on the Q/K/V/output projections, as GPT-2 has
    batch_size: int | None = None
    lr: float | None = None
    context: int | None = None  # training window = model max_seq_len
    eval_interval: int | None = None
    eval_tokens: int = 4096
    weight_decay: float = 0.1
    progress: bool = True  # tqdm bar (only shown on a terminal)
    verbose: bool = True  # evaluation lines and the final summary on stdout
    dump_rank_weights: str | None = None  # debug: every rank saves its final weights here
    on_checkpoint: Callable[[int, Path], None] | None = None  # called after each save (rank 0)


@dataclass
class TrainResult:
    out: Path
    steps: int
    final_train_loss: float
    final_val_loss: float
    val_perplexity: float
    unigram_val_loss: float
    tokens_per_second: float
    wall_time_s: float
    num_params: int


def check_options(opts: TrainOptions) -> None:
    """Reject bad input before any heavy work (one clear message each)."""
    if opts.preset is not None and opts.preset not in PRESETS:
        raise ValueError(f"unknown preset {opts.preset!r}; choose one of {sorted(PRESETS)}")
    for name in ("steps", "batch_size", "eval_interval", "vocab_size", "context"):
        value = getattr(opts, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    for name in ("time_budget", "lr"):
        value = getattr(opts, name)
        if value is not None and not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if opts.arch is not None and opts.arch not in architecture_names():
        raise ValueError(f"unknown architecture {opts.arch!r}; choose one of "
                         f"{list(architecture_names())}")
    if opts.preset is not None and opts.arch is not None \
            and PRESETS[opts.preset].arch != opts.arch:
        fitting = sorted(n for n, p in PRESETS.items() if p.arch == opts.arch)
        raise ValueError(f"preset {opts.preset!r} is a {PRESETS[opts.preset].arch} preset; "
                         f"with --arch {opts.arch} choose one of {fitting}")
    arch = architecture(opts.arch or (PRESETS[opts.preset].arch if opts.preset else "gpt"))
    if arch.fixed and (opts.position is not None or opts.activation is not None):
        fixed = ", ".join(f"{k} {v}" for k, v in arch.fixed.items())
        raise ValueError(f"--position and --activation apply to the gpt architecture; "
                         f"{arch.name} fixes {fixed}")
    if opts.activation is not None and opts.activation not in arch.activations:
        raise ValueError(f"--activation {opts.activation!r} is not one of {arch.name}'s: "
                         f"{list(arch.activations)}")
    if opts.eval_tokens <= 0:
        raise ValueError(f"eval_tokens must be positive, got {opts.eval_tokens}")
    if opts.tokenizer not in ("char", "bpe"):
        raise ValueError(f"unknown tokenizer {opts.tokenizer!r}; choose 'char' or 'bpe'")
    if opts.tokenizer == "bpe" and opts.vocab_size is not None and opts.vocab_size < 259:
        raise ValueError(f"--vocab-size {opts.vocab_size} is too small for byte-level BPE "
                         "(at least 256 bytes + 3 special tokens = 259)")
    if opts.device not in ("auto", "cpu", "cuda") and not opts.device.startswith("cuda:"):
        raise ValueError(f"unknown device {opts.device!r}; choose auto, cpu or cuda")
    if opts.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available")
    check_output(Path(opts.out), opts.resume)


def with_defaults(opts: TrainOptions) -> TrainOptions:
    """Fill preset, seed, batch size and learning rate: from the checkpoint when resuming
    (so a bare ``--resume`` continues the same run), else from the preset."""
    saved = read_meta(opts.out).training if opts.resume else {}
    default = architecture(opts.arch).default_preset if opts.arch else "small"
    preset = opts.preset or str(saved.get("preset", default))
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    return replace(
        opts, preset=preset,
        seed=opts.seed if opts.seed is not None else int(saved.get("seed", 0)),
        batch_size=opts.batch_size or int(saved.get("batch_size", p.batch_size)),
        lr=opts.lr or float(saved.get("learning_rate", p.learning_rate)))


def check_corpus_size(docs: list[str], context: int) -> None:
    """Cheap bound before any tokenizer work: a token covers at least one byte."""
    upper = sum(len(d.encode("utf-8")) for d in docs) + len(docs) * len(DOC_SEPARATOR)
    if upper < 2 * (context + 1):
        raise ValueError(
            f"corpus too short: at most {upper} tokens, but a context of {context} needs at "
            f"least {2 * (context + 1)} (one window each for training and validation)")


def check_output(out: Path, resume: bool) -> None:
    if resume:
        read_meta(out)  # raises CheckpointError naming what is missing
        return
    if out.exists() and not out.is_dir():
        raise OSError(f"output {out} exists and is not a directory")
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as exc:
        raise OSError(f"cannot write the checkpoint to {out}: {exc.strerror or exc}") from exc


def train(opts: TrainOptions) -> TrainResult:
    """Run one training job end to end; see the module docstring."""
    check_options(opts)
    opts = with_defaults(opts)
    assert opts.preset is not None and opts.seed is not None
    assert opts.batch_size is not None and opts.lr is not None
    out = Path(opts.out)
    preset = PRESETS[opts.preset]
    data_path = resolve_data_path(opts.data)
    docs = read_documents(data_path)
    context, start = opts.context or preset.max_seq_len, 0
    if opts.resume:
        meta = read_meta(out)
        context, start = meta.model.max_seq_len, int(meta.training.get("steps", 0))
    total = opts.steps if opts.steps is not None else (
        None if opts.time_budget is not None else preset.steps)
    if total is not None and total <= start:
        raise ValueError(f"checkpoint {out} is already at step {start}; "
                         "pass --steps larger than that to continue")
    check_corpus_size(docs, context)

    resumed = load_checkpoint(out, device="cpu") if opts.resume else None
    with processes(opts.device, tf32=True) as (info, device):
        if resumed is not None:
            tokenizer_json = resumed.tokenizer_path.read_text(encoding="utf-8")
        else:
            # Rank 0 trains the tokenizer; the others receive the very same vocabulary.
            vocab = opts.vocab_size or preset.vocab_size
            own = (build_tokenizer(opts.tokenizer, docs, vocab_size=vocab).to_str()
                   if info.is_main else None)
            tokenizer_json = dist_utils.broadcast_text(own, info, device)
        tokenizer = Tokenizer.from_str(tokenizer_json)
        specials = (checkpoint_special_ids(tokenizer, resumed.meta.tokenizer)
                    if resumed is not None else special_ids(tokenizer))
        if specials.eos_token_id is None:
            raise ValueError("the tokenizer has no end-of-text token to separate documents")

        if resumed is not None:
            config = resumed.meta.model
        else:
            config = config_from_preset(
                opts.preset, vocab_size=tokenizer.get_vocab_size(),
                position=opts.position or "learned", activation=opts.activation or "relu",
                tie_weights=opts.tie_weights,
                attn_bias=opts.attn_bias)
            if opts.context is not None:
                config = replace(config, max_seq_len=opts.context)
        splits = split_stream(encode_documents(tokenizer, docs, specials.eos_token_id),
                              config.max_seq_len)
        kind = resumed.meta.tokenizer.get("kind", "bpe") if resumed else opts.tokenizer
        meta = CheckpointMeta(model=config, tokenizer={"kind": kind, **specials.to_dict()})
        job = _GPTJob(opts, info, device, str(data_path), splits, meta, tokenizer_json,
                      resumed, start)
        metrics = ([m for m in read_metrics(out) if int(m.get("step", 0)) <= start]
                   if resumed is not None else [])
        job.say(f"training {opts.preset} ({job.model.num_params():,} parameters, vocab "
                f"{config.vocab_size}, context {config.max_seq_len}) on {data_path}: "
                f"{len(splits.train):,} train / {job.val_y.numel():,} val tokens, "
                f"{info.world_size} process(es) on {device.type}")
        if resumed is not None:
            job.evaluate(start, None)
        eval_every = opts.eval_interval or max(1, ((total - start) if total else 1000) // 5)
        end = run(job, Schedule(start, total, opts.lr, WARMUP, eval_every, opts.time_budget),
                  info, device, metrics, opts.progress, opts.on_checkpoint, out)
        if opts.dump_rank_weights:
            dump = Path(opts.dump_rank_weights)
            dump.mkdir(parents=True, exist_ok=True)
            save_model(job.model, str(dump / f"rank{info.rank}.safetensors"))
        job.say(f"done: {end.step} steps in {end.wall_s:.1f} s ({end.tokens_per_s:,.0f} "
                f"tokens/s) | train loss {end.train_loss:.4f} | val loss {job.val_loss:.4f} "
                f"(perplexity {job.val_ppl:.1f}) vs unigram baseline {job.unigram:.4f} -> {out}")
        return TrainResult(out=out, steps=end.step, final_train_loss=end.train_loss,
                           final_val_loss=job.val_loss, val_perplexity=job.val_ppl,
                           unigram_val_loss=job.unigram, tokens_per_second=end.tokens_per_s,
                           wall_time_s=end.wall_s, num_params=job.model.num_params())


class _GPTJob:
    """What `train` gives the training loop: random windows of the corpus, the model's mean
    cross-entropy on them, validation loss beside the unigram baseline, a checkpoint."""

    def __init__(self, opts: TrainOptions, info: DistInfo, device: torch.device,
                 data_path: str, splits: TokenSplits, meta: CheckpointMeta, tokenizer_json: str,
                 resumed: Checkpoint | None, start: int) -> None:
        assert opts.seed is not None and opts.batch_size is not None and opts.lr is not None
        self.opts, self.info, self.device, self.data_path = opts, info, device, data_path
        self.meta, self.tokenizer_json = meta, tokenizer_json  # meta.training: at each save
        context = meta.model.max_seq_len
        self.val_x, self.val_y = eval_windows(splits.val, context, opts.eval_tokens)
        self.unigram = unigram_cross_entropy(splits.train, self.val_y, meta.model.vocab_size)
        self.val_loss = self.val_ppl = math.nan
        self.train_tokens = len(splits.train)
        torch.manual_seed(opts.seed)
        self.model = GPT(meta.model)
        if resumed is not None:
            self.model.load_state_dict(resumed.model.state_dict())
        self.model.to(device).train()
        self.params = list(self.model.parameters())
        self.optimizer = make_optimizer(self.model, opts.lr, opts.weight_decay)
        self.sampler = BatchSampler(splits.train, context, opts.batch_size, opts.seed,
                                    info.rank)
        out = Path(opts.out)
        if resumed is not None and not load_train_state(out, self.model, self.optimizer, start):
            self.say(f"note: no optimizer state for step {start} in {out}; "
                     "AdamW moments start from zero")

    def say(self, message: str) -> None:
        say(message, self.info, self.opts.verbose)

    def step(self, k: int) -> Step:
        x, y = self.sampler.batch(k)
        # one batch's mean loss per rank: the step's is their mean
        return Step([(x.to(self.device), y.to(self.device))], self.info.world_size, x.numel())

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        return model(batch[0], targets=batch[1]).loss  # the batch's mean

    def evaluate(self, step: int, train_loss: float | None) -> dict[str, Any]:
        """Mean cross-entropy (nats/token) over the fixed validation windows."""
        self.model.eval()
        total, size = 0.0, self.sampler.batch_size
        for i in range(0, len(self.val_x), size):
            xb, yb = self.val_x[i:i + size].to(self.device), self.val_y[i:i + size].to(self.device)
            with torch.no_grad(), autocast(self.device):
                loss = self.model(xb, targets=yb).loss
            assert loss is not None
            total += float(loss) * len(xb)
        self.model.train()
        self.val_loss = total / len(self.val_x)
        self.val_ppl = math.exp(min(self.val_loss, 50.0))
        self.say(f"step {step}: val loss {self.val_loss:.4f} (perplexity {self.val_ppl:.1f}) | "
                 f"unigram baseline {self.unigram:.4f}")
        return {"val_loss": self.val_loss, "val_perplexity": self.val_ppl}

    def save(self, step: int, metrics: list[dict[str, Any]], stats: Stats) -> None:
        opts, out = self.opts, Path(self.opts.out)
        training = {
            "preset": opts.preset, "data": opts.data, "data_path": self.data_path,
            "seed": opts.seed, "steps": step, "batch_size": opts.batch_size,
            "learning_rate": opts.lr, "world_size": self.info.world_size,
            "device": self.device.type, "final_train_loss": stats.train_loss,
            "final_val_loss": self.val_loss, "final_val_perplexity": self.val_ppl,
            "unigram_val_loss": self.unigram, "tokens_per_second": stats.tokens_per_s,
            "wall_time_s": stats.wall_s, "train_tokens": self.train_tokens,
            "val_tokens": self.val_y.numel(), "num_params": self.model.num_params(),
            "torch_version": torch.__version__,
        }
        save_checkpoint(out, self.model, replace(self.meta, training=training),
                        self.tokenizer_json, metrics)
        save_train_state(out, self.model, self.optimizer, step)
