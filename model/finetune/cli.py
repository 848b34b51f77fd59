"""`attnserve finetune` and `attnserve merge`: parsers only; the handlers import torch
when they run, so `attnserve --help` stays fast.

Usage:
    attnserve finetune --ckpt checkpoints/smollm2 --data chat.jsonl --out adapters/mine
    attnserve merge --ckpt checkpoints/smollm2 --adapter adapters/mine --out checkpoints/mine
"""

from __future__ import annotations

import argparse
import time

from model.finetune.options import FULL_LR, LORA_LR, FinetuneOptions


def register(subparsers: argparse._SubParsersAction,
             formatter: type[argparse.HelpFormatter]) -> None:
    _register_finetune(subparsers, formatter)
    _register_merge(subparsers, formatter)


def _register_finetune(subparsers: argparse._SubParsersAction,
                       formatter: type[argparse.HelpFormatter]) -> None:
    d = FinetuneOptions(ckpt="", data="", out="")
    p = subparsers.add_parser(
        "finetune", help="fine-tune a checkpoint on chat / prompt-completion / text JSONL "
                         "(LoRA, PEFT's format; or --full)",
        description="Supervised fine-tuning of any checkpoint attnserve serves (GGUF or "
                    "Hugging Face imports, our own GPTs) on a JSONL data set in the formats "
                    "TRL's SFTTrainer reads: {\"messages\": [...]} rendered with the "
                    "checkpoint's chat template and trained on the assistant turns only "
                    "(their end-of-turn token included), {\"prompt\", \"completion\"} trained "
                    "on the completion, {\"text\"} trained on everything. A bad line is "
                    "refused with its line number before anything is written. By default a "
                    "LoRA adapter (r 16, alpha 32, dropout 0.05 on every projection) is "
                    "trained over the frozen base, a GGUF file's blocks staying blocks (with "
                    "chat data, beside the base's own answers to general prompts, so other "
                    "answers stay as they were: --rehearsal), and "
                    "written to --out in PEFT's format (adapter_config.json + "
                    "adapter_model.safetensors), loadable by PEFT, vLLM and TGI; `attnserve "
                    "merge` folds it into a checkpoint. --full trains every weight and writes "
                    "a checkpoint. Runs unchanged under `torchrun --nproc_per_node N "
                    "--no-python attnserve finetune ...`.",
        formatter_class=formatter)
    p.add_argument("--ckpt", required=True, metavar="DIR", help="the checkpoint to fine-tune")
    p.add_argument("--data", required=True, metavar="FILE.jsonl", help="training examples")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="where the adapter (or, with --full, the checkpoint) goes; written "
                        "atomically at each evaluation; must be absent or empty unless "
                        "--force or --resume")
    p.add_argument("--eval-data", default=None, metavar="FILE.jsonl",
                   help="held-out examples to evaluate on (loss, perplexity, token accuracy)")
    p.add_argument("--eval-fraction", type=float, default=None, metavar="F",
                   help="without --eval-data: hold out this fraction of --data (default: 0.1 "
                        "with 20 examples or more, else none)")
    p.add_argument("--full", action="store_true",
                   help="train every weight (float32) instead of a LoRA adapter; --out is "
                        "then a checkpoint")
    p.add_argument("--lora-r", dest="rank", type=int, default=d.rank, metavar="R",
                   help="LoRA rank")
    p.add_argument("--lora-alpha", dest="alpha", type=float, default=d.alpha,
                   help="LoRA alpha: the update is scaled by alpha / r (alpha / √r with "
                        "--rslora)")
    p.add_argument("--lora-dropout", dest="dropout", type=float, default=d.dropout,
                   help="dropout on each adapted projection's input")
    p.add_argument("--rslora", action="store_true", help="rank-stabilised LoRA scaling")
    p.add_argument("--target-modules", default="", metavar="NAMES",
                   help="comma-separated projections to adapt, by transformers' names "
                        "(q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj for "
                        "Llama-type models; c_attn,c_proj,c_fc for GPT-2); default: all")
    p.add_argument("--epochs", type=int, default=d.epochs,
                   help="passes over the training examples")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help="optimizer steps (overrides --epochs)")
    p.add_argument("--lr", type=float, default=None,
                   help=f"peak AdamW learning rate (warm-up then cosine); default: {LORA_LR:g} "
                        f"for LoRA, {FULL_LR:g} with --full")
    p.add_argument("--warmup", type=float, default=d.warmup, metavar="F",
                   help="fraction of the steps the learning rate warms up over")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay,
                   help="AdamW weight decay, on matrices only")
    p.add_argument("--batch-size", type=int, default=d.batch_size, metavar="N",
                   help="examples per micro-batch and process (grouped by length)")
    p.add_argument("--accumulation", type=int, default=d.accumulation, metavar="N",
                   help="micro-batches per optimizer step (gradient accumulation)")
    p.add_argument("--max-length", type=int, default=d.max_length, metavar="N",
                   help="tokens an example keeps (capped by the model's context); an "
                        "example left with nothing to learn is skipped and counted")
    p.add_argument("--rehearsal", type=int, default=d.rehearsal, metavar="N",
                   help="with chat data, also train on the base model's own answers to N "
                        "general prompts (model/finetune/rehearsal_prompts.txt), so answers "
                        "outside the new data stay as they were; 0: off")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="keep only each layer's input and recompute the layer in the "
                        "backward: far less memory for about a third more time")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="seed of LoRA's initialisation, the batches, the held-out split and "
                        "dropout; CPU runs are repeatable")
    p.add_argument("--device", default=d.device, metavar="auto|cpu|cuda",
                   help="where to train; auto picks CUDA when available (bf16 autocast)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its last save, with its own options")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument("--show-masks", type=int, default=None, metavar="N",
                   help="print N rendered examples with what is learned marked, and exit "
                        "without training")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(handler=_finetune)


def _register_merge(subparsers: argparse._SubParsersAction,
                    formatter: type[argparse.HelpFormatter]) -> None:
    p = subparsers.add_parser(
        "merge", help="fold a PEFT LoRA adapter into its base checkpoint (float32)",
        description="Write a new checkpoint whose float32 weights are the base's plus each "
                    "adapted projection's scale·B·A: it exports and serves like any "
                    "checkpoint, and `export --quantize` may quantise it again. Any PEFT "
                    "LoRA adapter of a base of these shapes merges (ours, or one trained by "
                    "TRL, PEFT or unsloth); DoRA, modules_to_save, trained biases, targets "
                    "this model lacks and adapters of other shapes are refused.",
        formatter_class=formatter)
    p.add_argument("--ckpt", required=True, metavar="DIR", help="the base checkpoint")
    p.add_argument("--adapter", required=True, metavar="DIR",
                   help="a PEFT LoRA adapter directory (adapter_config.json + "
                        "adapter_model.safetensors)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="the merged checkpoint (written atomically; absent or empty unless "
                        "--force)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.set_defaults(handler=_merge)


def _finetune(args: argparse.Namespace) -> int:
    from model.finetune.trainer import finetune

    targets = tuple(t.strip() for t in args.target_modules.split(",") if t.strip())
    finetune(FinetuneOptions(
        ckpt=args.ckpt, data=args.data, out=args.out, eval_data=args.eval_data,
        eval_fraction=args.eval_fraction, full=args.full, rank=args.rank, alpha=args.alpha,
        dropout=args.dropout, rslora=args.rslora, target_modules=targets, epochs=args.epochs,
        steps=args.steps, lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay,
        batch_size=args.batch_size, accumulation=args.accumulation,
        max_length=args.max_length, gradient_checkpointing=args.gradient_checkpointing,
        rehearsal=args.rehearsal,
        seed=args.seed, device=args.device, resume=args.resume, force=args.force,
        show_masks=args.show_masks, progress=not args.no_progress))
    return 0


def _merge(args: argparse.Namespace) -> int:
    from model.finetune.merge import merge

    started = time.perf_counter()
    out = merge(args.ckpt, args.adapter, args.out, force=args.force)
    print(f"merged {args.adapter} into {args.ckpt} → {out} in "
          f"{time.perf_counter() - started:.1f}s")
    return 0
