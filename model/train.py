"""Train a GPT on a text corpus and write a checkpoint directory.

Usage:
    attnserve train --data stdlib --preset small --out checkpoints/default
    attnserve train --data notes.txt --preset tiny --out /tmp/ckpt --steps 200 --tokenizer char
    torchrun --standalone --nproc_per_node 2 --no-python attnserve train --preset tiny --out ck

AdamW with cross-entropy, gradient-norm clipping at 1.0 (seed 003), a linear warm-up then
a cosine decay to 10% of the peak learning rate, periodic validation loss and perplexity
beside a unigram baseline, bf16 autocast on CUDA, and DistributedDataParallel when
launched by torchrun (rank 0 writes the checkpoint). On CPU a run is a deterministic
function of its seed. ``--resume`` continues the checkpoint in ``--out``: weights, AdamW
moments (train_state.safetensors) and the step count; ``--steps`` is then the total, and
since the learning rate depends on step/total and batch ``k`` on (seed, rank, k) alone, a
resumed run ends bit-identical to one that was never interrupted.
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from model.architectures import architecture, architecture_names
from model.checkpoint import CheckpointMeta, read_meta
from model.config import PRESETS, GPTConfig
from model.data import DOC_SEPARATOR, read_documents, resolve_data_path

if TYPE_CHECKING:
    import torch

    from model.distributed import DistInfo
    from model.gpt import GPT

MIN_LR_RATIO = 0.1


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
    if opts.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
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
    """Cheap bound before any tokenizer or torch work: a token covers at least one byte."""
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


def pick_device(requested: str, info: DistInfo) -> torch.device:
    import torch

    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and info.enabled:
        return torch.device("cuda", info.local_rank)
    return torch.device(requested)


def lr_at(progress: float, peak: float, warmup: float) -> float:
    """Linear warm-up over the first ``warmup`` fraction, then cosine down to 10% of peak."""
    if progress < warmup:
        return peak * (progress + 1e-3) / warmup
    decay = min(1.0, (progress - warmup) / max(1e-9, 1.0 - warmup))
    return peak * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * decay)))


def evaluate(model: GPT, x: torch.Tensor, y: torch.Tensor, device: torch.device,
             batch_size: int) -> float:
    """Mean cross-entropy (nats/token) over fixed validation windows."""
    import torch

    model.eval()
    total = 0.0
    for i in range(0, len(x), batch_size):
        xb, yb = x[i:i + batch_size].to(device), y[i:i + batch_size].to(device)
        with torch.no_grad(), _autocast(device):
            loss = model(xb, targets=yb).loss
        assert loss is not None
        total += float(loss) * len(xb)
    model.train()
    return total / len(x)


def _autocast(device: torch.device) -> Any:
    import torch

    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def _log(opts: TrainOptions, info: DistInfo, message: str) -> None:
    if opts.verbose and info.is_main:
        from tqdm import tqdm

        tqdm.write(message, file=sys.stdout)  # above the progress bar, not through it
        sys.stdout.flush()


def _prepare_tokenizer(opts: TrainOptions, docs: list[str], preset_vocab: int) -> str:
    from model.tokenizer import build_tokenizer

    vocab = opts.vocab_size or preset_vocab
    return str(build_tokenizer(opts.tokenizer, docs, vocab_size=vocab).to_str())


def train(opts: TrainOptions) -> TrainResult:
    """Run one training job end to end; see the module docstring."""
    check_options(opts)
    opts = with_defaults(opts)
    assert opts.preset is not None
    out = Path(opts.out)
    preset = PRESETS[opts.preset]
    data_path = resolve_data_path(opts.data)
    docs = read_documents(data_path)
    context = opts.context or preset.max_seq_len
    if opts.resume:
        meta = read_meta(out)
        context, done = meta.model.max_seq_len, int(meta.training.get("steps", 0))
        if opts.steps is not None and opts.steps <= done:
            raise ValueError(f"checkpoint {out} is already at step {done}; "
                             "pass --steps larger than that to continue")
    check_corpus_size(docs, context)

    # Bad input has been reported by now; only here do torch and friends get imported.
    import torch
    from tokenizers import Tokenizer
    from tqdm import tqdm

    from model import distributed as dist_utils
    from model.checkpoint import load_checkpoint
    from model.config import config_from_preset
    from model.data import encode_documents, eval_windows, split_stream, unigram_cross_entropy
    from model.tokenizer import checkpoint_special_ids, special_ids

    info = dist_utils.env_info()
    device = pick_device(opts.device, info)
    resumed = load_checkpoint(out, device="cpu") if opts.resume else None
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    dist_utils.init(info, device)
    try:
        if resumed is not None:
            tokenizer_json = resumed.tokenizer_path.read_text(encoding="utf-8")
        else:
            # Rank 0 trains the tokenizer; the others receive the very same vocabulary.
            own = _prepare_tokenizer(opts, docs, preset.vocab_size) if info.is_main else None
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
        context = config.max_seq_len
        splits = split_stream(encode_documents(tokenizer, docs, specials.eos_token_id), context)
        val_x, val_y = eval_windows(splits.val, context, opts.eval_tokens)
        unigram = unigram_cross_entropy(splits.train, val_y, config.vocab_size)
        kind = resumed.meta.tokenizer.get("kind", "bpe") if resumed else opts.tokenizer
        tokenizer_meta = {"kind": kind, **specials.to_dict()}
        return _run(opts, info, device, out, config, tokenizer_json, tokenizer_meta,
                    splits.train, val_x, val_y, unigram, resumed, str(data_path), tqdm)
    finally:
        dist_utils.shutdown()


def _run(opts: TrainOptions, info: DistInfo, device: torch.device, out: Path,
         config: GPTConfig, tokenizer_json: str, tokenizer_meta: dict[str, Any],
         train_ids: torch.Tensor, val_x: torch.Tensor, val_y: torch.Tensor, unigram: float,
         resumed: Any, data_path: str, tqdm: Any) -> TrainResult:
    import torch
    from torch import nn

    from model import distributed as dist_utils
    from model.checkpoint import save_checkpoint
    from model.data import BatchSampler
    from model.gpt import GPT
    from model.train_state import load_train_state, make_optimizer, save_train_state

    assert opts.preset is not None and opts.seed is not None
    assert opts.batch_size is not None and opts.lr is not None
    preset = PRESETS[opts.preset]
    batch_size, peak_lr = opts.batch_size, opts.lr
    start_step = int(resumed.meta.training.get("steps", 0)) if resumed is not None else 0
    total_steps = opts.steps if opts.steps is not None else (
        None if opts.time_budget is not None else preset.steps)
    if total_steps is not None and total_steps <= start_step:
        raise ValueError(f"checkpoint {out} is already at step {start_step}; "
                         "pass --steps larger than that to continue")

    torch.manual_seed(opts.seed)
    model = GPT(config)
    if resumed is not None:
        model.load_state_dict(resumed.model.state_dict())
    model.to(device).train()
    optimizer = make_optimizer(model, peak_lr, opts.weight_decay)
    if resumed is not None and not load_train_state(out, model, optimizer, start_step):
        _log(opts, info, f"note: no optimizer state for step {start_step} in {out}; "
                         "AdamW moments start from zero")
    wrapped: nn.Module = model
    if info.enabled:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    sampler = BatchSampler(train_ids, config.max_seq_len, batch_size, opts.seed, info.rank)

    steps_here = (total_steps - start_step) if total_steps is not None else None
    eval_every = opts.eval_interval or max(1, (steps_here or 1000) // 5)
    warmup = 0.05
    metrics: list[dict[str, Any]] = []
    if resumed is not None:
        from model.checkpoint import read_metrics

        metrics = [m for m in read_metrics(out) if int(m.get("step", 0)) <= start_step]
    _log(opts, info, f"training {opts.preset} ({model.num_params():,} parameters, vocab "
                     f"{config.vocab_size}, context {config.max_seq_len}) on {data_path}: "
                     f"{len(train_ids):,} train / {val_y.numel():,} val tokens, "
                     f"{info.world_size} process(es) on {device.type}")

    def summary(step: int, tok_s: float, wall: float) -> dict[str, Any]:
        return {
            "preset": opts.preset, "data": opts.data, "data_path": data_path,
            "seed": opts.seed, "steps": step, "batch_size": batch_size,
            "learning_rate": peak_lr, "world_size": info.world_size, "device": device.type,
            "final_train_loss": sum(recent) / len(recent) if recent else math.nan,
            "final_val_loss": val_loss, "final_val_perplexity": val_ppl,
            "unigram_val_loss": unigram, "tokens_per_second": tok_s, "wall_time_s": wall,
            "train_tokens": len(train_ids), "val_tokens": val_y.numel(),
            "num_params": model.num_params(), "torch_version": torch.__version__,
        }

    def save(step: int, training: dict[str, Any]) -> None:
        meta = CheckpointMeta(model=config, tokenizer=dict(tokenizer_meta), training=training)
        save_checkpoint(out, model, meta, tokenizer_json, metrics)
        save_train_state(out, model, optimizer, step)
        if opts.on_checkpoint is not None:
            opts.on_checkpoint(step, out)

    def run_eval(step: int) -> tuple[float, float]:
        val = evaluate(model, val_x, val_y, device, batch_size)
        ppl = math.exp(min(val, 50.0))
        _log(opts, info, f"step {step}: val loss {val:.4f} (perplexity {ppl:.1f}) | "
                         f"unigram baseline {unigram:.4f}")
        return val, ppl

    val_loss, val_ppl = run_eval(start_step) if resumed is not None else (math.nan, math.nan)
    tokens_per_step = batch_size * config.max_seq_len * info.world_size
    bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
               disable=not (opts.progress and info.is_main and sys.stderr.isatty()))
    t0 = time.perf_counter()
    step, recent = start_step, list[float]()
    train_seconds = 0.0
    while True:
        elapsed = time.perf_counter() - t0
        # Rank 0's clock decides, so every rank takes the same learning rate and stops together.
        (elapsed,) = dist_utils.sum_across([elapsed if info.is_main else 0.0], info, device)
        progress = max((step / total_steps) if total_steps else 0.0,
                       (elapsed / opts.time_budget) if opts.time_budget else 0.0)
        if progress >= 1.0:
            break
        lr = lr_at(progress, peak_lr, warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr
        t_step = time.perf_counter()
        x, y = sampler.batch(step)
        x, y = x.to(device), y.to(device)
        with _autocast(device):
            loss = wrapped(x, targets=y).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        (loss_sum,) = dist_utils.sum_across([float(loss.detach())], info, device)
        train_loss = loss_sum / info.world_size
        train_seconds += time.perf_counter() - t_step
        step += 1
        recent = [*recent[-9:], train_loss]
        tok_s = tokens_per_step * (step - start_step) / max(train_seconds, 1e-9)
        row: dict[str, Any] = {"step": step, "train_loss": train_loss, "lr": lr,
                               "tokens_per_s": tok_s,
                               "elapsed_s": time.perf_counter() - t0}
        bar.update(1)
        bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tok_s:,.0f}")
        last = total_steps is not None and step >= total_steps
        if step % eval_every == 0 or last:
            val_loss, val_ppl = run_eval(step)
            row |= {"val_loss": val_loss, "val_perplexity": val_ppl}
        metrics.append(row)
        if info.is_main and step % eval_every == 0 and not last:
            save(step, summary(step, tok_s, time.perf_counter() - t0))
    bar.close()
    if metrics and "val_loss" not in metrics[-1]:  # stopped by the time budget
        val_loss, val_ppl = run_eval(step)
        metrics[-1] |= {"val_loss": val_loss, "val_perplexity": val_ppl}
    wall = time.perf_counter() - t0
    tok_s = tokens_per_step * (step - start_step) / max(train_seconds, 1e-9)
    final = summary(step, tok_s, wall)
    if info.is_main:
        save(step, final)
    if opts.dump_rank_weights:
        from safetensors.torch import save_model

        dump = Path(opts.dump_rank_weights)
        dump.mkdir(parents=True, exist_ok=True)
        save_model(model, str(dump / f"rank{info.rank}.safetensors"))
    _log(opts, info, f"done: {step} steps in {wall:.1f} s ({tok_s:,.0f} tokens/s) | "
                     f"train loss {final['final_train_loss']:.4f} | val loss {val_loss:.4f} "
                     f"(perplexity {val_ppl:.1f}) vs unigram baseline {unigram:.4f} -> {out}")
    return TrainResult(out=out, steps=step, final_train_loss=final["final_train_loss"],
                       final_val_loss=val_loss, val_perplexity=val_ppl,
                       unigram_val_loss=unigram, tokens_per_second=tok_s, wall_time_s=wall,
                       num_params=model.num_params())
