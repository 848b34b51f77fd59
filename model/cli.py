"""`attnserve train`, `attnserve sample`, `attnserve import` (and, from model/finetune/cli.py,
`attnserve finetune` and `attnserve merge`).

Usage:
    attnserve train --data stdlib --preset small --out checkpoints/default
    attnserve sample --ckpt checkpoints/default --prompt "Return the" --max-new-tokens 80
    attnserve import --hf models/distilgpt2 --out checkpoints/distilgpt2
    attnserve import --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf --out checkpoints/smollm2

Parsers only; the handlers import torch when they run, so `attnserve --help` stays fast
and works where only the serving extra is installed.
"""

from __future__ import annotations

import argparse
import sys

from model.architectures import architecture_names
from model.config import PRESETS

# Every family the importers read, for the help texts (the registry would import torch to
# list them; tests/model/finetune/test_cli.py checks these against it).
FAMILIES = "GPT-2, Llama, Qwen2, Qwen3, SmolLM3, Mistral, Phi-3, Gemma 3"
GGUF_FAMILIES = ("llama", "qwen2", "qwen3", "smollm3", "phi3", "gemma3", "gpt2")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, except the uninformative None/False ones."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, "", argparse.SUPPRESS):
            return action.help
        return super()._get_help_string(action)


def register(subparsers: argparse._SubParsersAction) -> None:
    from model.finetune import cli as finetune_cli

    _register_train(subparsers)
    _register_sample(subparsers)
    _register_import(subparsers)
    finetune_cli.register(subparsers, _HelpFormatter)


def _register_import(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "import", help=f"convert a local Hugging Face directory or a GGUF file ({FAMILIES}) "
                       "into a checkpoint",
        description=f"Import a model of one of the families {FAMILIES}. "
                    "Read a local Hugging Face directory of GPT2LMHeadModel, LlamaForCausalLM "
                    "(SmolLM2, TinyLlama, Llama 3), Qwen2ForCausalLM (Qwen2.5), "
                    "Qwen3ForCausalLM, SmolLM3ForCausalLM, MistralForCausalLM, "
                    "Phi3ForCausalLM (Phi-3, Phi-4-mini) or Gemma3ForCausalLM (config.json, "
                    "model.safetensors or its sharded index, tokenizer.json (or, for GPT-2, "
                    "vocab.json + merges.txt), generation_config.json), or a llama.cpp GGUF "
                    f"file of the {', '.join(GGUF_FAMILIES)} architecture (F32/F16/BF16, "
                    "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q2_K..Q6_K, held as they "
                    "are and dequantised to float32 on load; byte-level BPE or SentencePiece "
                    "tokenizer), and write an attnserve checkpoint directory (atomically), "
                    "with the chat template, tokenizer_config.json and "
                    "generation_config.json beside it. Nothing is downloaded; pickled weights "
                    "(pytorch_model.bin), other tensor types and configuration options the "
                    "model does not compute are refused.",
        formatter_class=_HelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", metavar="DIR",
                        help="Hugging Face model directory, e.g. from `hf download distilgpt2 "
                             "--local-dir DIR`")
    source.add_argument("--gguf", metavar="FILE",
                        help="GGUF model file, e.g. SmolLM2-135M-Instruct.Q4_1.gguf "
                             "(`make default-model` installs it under .cache/)")
    p.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory to write")
    p.add_argument("--float32", action="store_true",
                   help="with --gguf: write every weight dequantised to float32 "
                        "(model.safetensors) instead of holding the GGUF file itself as the "
                        "checkpoint's weights (model.gguf, a hard link where possible; loading "
                        "dequantises it, `export --quantize gguf` keeps its blocks)")
    p.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--sampling", action="append", default=[], metavar="KEY=VALUE",
                   help="a recommended sampling default written into generation_config.json "
                        "(temperature, top_p, top_k, min_p, repetition_penalty; repeatable): "
                        "the OpenAI routes use it when a request leaves the field out")
    p.set_defaults(handler=_import)


def _register_train(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train", help="train a GPT on a text corpus and write a checkpoint directory",
        description="Train a GPT and write config.json, model.safetensors, tokenizer.json and "
                    "metrics.jsonl to --out (atomically). Runs unchanged under "
                    "`torchrun --nproc_per_node N --no-python attnserve train ...` "
                    "(DistributedDataParallel; rank 0 writes the checkpoint).",
        formatter_class=_HelpFormatter)
    p.add_argument("--data", default="stdlib", metavar="FILE|stdlib",
                   help="UTF-8 text file to train on (documents separated by lines holding "
                        "only <end>), or 'stdlib': the Python standard library's docstrings, "
                        "built and cached on first use")
    p.add_argument("--preset", default=None, metavar="|".join(PRESETS),
                   help="model size and schedule (default: small, or the checkpoint's when "
                        "resuming): " + "; ".join(
                       f"{name}: {p.arch}, d_model {p.d_model}, {p.n_heads} heads"
                       f"{f' ({p.n_kv_heads} kv)' if p.n_kv_heads else ''}, {p.n_layers} layers, "
                       f"d_ff {p.d_ff}, context {p.max_seq_len}, {p.steps} steps"
                       for name, p in PRESETS.items()))
    p.add_argument("--out", required=True, metavar="DIR",
                   help="checkpoint directory to write (replaced atomically)")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help="optimizer steps (the total, when resuming); default: the preset's, "
                        "unless --time-budget is given")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="stop after this much wall time (the LR schedule follows the clock); "
                        "with --steps, whichever comes first")
    p.add_argument("--seed", type=int, default=None,
                   help="seed for initialisation and batch sampling; CPU runs are repeatable "
                        "(default: 0, or the checkpoint's when resuming)")
    p.add_argument("--device", default="auto", metavar="auto|cpu|cuda",
                   help="where to train; auto picks CUDA when available (bf16 autocast)")
    p.add_argument("--resume", action="store_true",
                   help="continue the checkpoint in --out (weights, AdamW state, step count) "
                        "with its own tokenizer and model config")
    p.add_argument("--tokenizer", choices=("bpe", "char"), default="bpe",
                   help="byte-level BPE trained on the corpus, or one token per character")
    p.add_argument("--vocab-size", type=int, default=None, metavar="N",
                   help="BPE vocabulary size; default: the preset's (4096 for small/base)")
    p.add_argument("--arch", choices=architecture_names(), default=None,
                   help="gpt (LayerNorm, learned/sinusoidal positions, MLP) or llama "
                        "(RMSNorm, rotary positions, SwiGLU, grouped-query attention; "
                        "presets llama-tiny / llama-small, the default); default: the preset's")
    p.add_argument("--position", choices=("learned", "sinusoidal"), default=None,
                   help="gpt only: learned position embeddings (default) or the fixed "
                        "sinusoidal encoding")
    p.add_argument("--activation", default=None, metavar="relu|gelu|gelu_tanh",
                   help="gpt only: feed-forward activation, relu (default); gelu is the "
                        "exact (erf) GELU, gelu_tanh the tanh approximation GPT-2 uses "
                        "(transformers' gelu_new)")
    p.add_argument("--attn-bias", action="store_true",
                   help="biases on the attention Q/K/V/output projections, as GPT-2 has")
    p.add_argument("--tie-weights", action="store_true",
                   help="share the token embedding matrix with the LM head")
    p.add_argument("--batch-size", type=int, default=None, metavar="N",
                   help="sequences per step and process; default: the preset's (the "
                        "checkpoint's when resuming)")
    p.add_argument("--lr", type=float, default=None,
                   help="peak AdamW learning rate (warm-up then cosine); default: the "
                        "preset's (the checkpoint's when resuming)")
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help="training window and the model's max_seq_len; default: the preset's")
    p.add_argument("--eval-interval", type=int, default=None, metavar="N",
                   help="steps between validation runs (and intermediate checkpoints); "
                        "default: a fifth of the run")
    p.add_argument("--eval-tokens", type=int, default=4096, metavar="N",
                   help="validation tokens scored at each evaluation")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--dump-rank-weights", default=None, metavar="DIR",
                   help=argparse.SUPPRESS)  # debugging/tests: each rank saves its weights
    p.set_defaults(handler=_train)


def _register_sample(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "sample", help="print a continuation of a prompt from a checkpoint (PyTorch)",
        description="Generate text with the KV cache from a checkpoint directory. Refuses "
                    "pickled .pt/.pkl files.",
        formatter_class=_HelpFormatter)
    p.add_argument("--ckpt", required=True, metavar="DIR", help="checkpoint directory")
    p.add_argument("--prompt", default="", help="text to continue (empty: start a document)")
    p.add_argument("--max-new-tokens", type=int, default=100, metavar="N",
                   help="tokens to generate at most (also bounded by the model's context)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="softmax temperature (> 0); lower is more conservative")
    p.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="sample only among the K most likely tokens")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="nucleus sampling: the smallest set of tokens with probability >= P")
    p.add_argument("--seed", type=int, default=None, help="seed for repeatable sampling")
    p.add_argument("--greedy", action="store_true",
                   help="always take the most likely token (ignores temperature/top-k/top-p)")
    p.add_argument("--echo-prompt", action="store_true",
                   help="print the prompt before the continuation")
    p.add_argument("--device", default="cpu", metavar="cpu|cuda", help="where to run")
    p.set_defaults(handler=_sample)


def _train(args: argparse.Namespace) -> int:
    from model.train import TrainOptions, train

    train(TrainOptions(
        out=args.out, data=args.data, preset=args.preset, steps=args.steps,
        time_budget=args.time_budget, seed=args.seed, device=args.device, resume=args.resume,
        tokenizer=args.tokenizer, vocab_size=args.vocab_size, position=args.position,
        arch=args.arch,
        activation=args.activation, tie_weights=args.tie_weights, attn_bias=args.attn_bias,
        batch_size=args.batch_size,
        lr=args.lr, context=args.context, eval_interval=args.eval_interval,
        eval_tokens=args.eval_tokens, progress=not args.no_progress,
        dump_rank_weights=args.dump_rank_weights))
    return 0


def _import(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from model.hf_import import import_hf_checkpoint, parse_sampling

    started = time.perf_counter()
    sampling = parse_sampling(args.sampling)
    if args.gguf is not None:
        from model.gguf.to_checkpoint import import_gguf_checkpoint

        source, out = args.gguf, import_gguf_checkpoint(Path(args.gguf), Path(args.out),
                                                        force=args.force, sampling=sampling,
                                                        float32=args.float32)
    else:
        if args.float32:
            print("attnserve import: --float32 applies to --gguf only (a Hugging Face "
                  "directory's weights are always written as float32 safetensors)",
                  file=sys.stderr)
            return 2
        source, out = args.hf, import_hf_checkpoint(Path(args.hf), Path(args.out),
                                                    force=args.force, sampling=sampling)
    print(f"imported {source} → {out} in {time.perf_counter() - started:.1f}s")
    return 0


def _sample(args: argparse.Namespace) -> int:
    from model.sample import sample_text

    text = sample_text(
        args.ckpt, args.prompt, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        greedy=args.greedy, device=args.device)
    sys.stdout.write((args.prompt if args.echo_prompt else "") + text + "\n")
    return 0
