"""`attnserve eval`: perplexity and bits per byte of an artifact or a checkpoint.

Usage:
    attnserve eval --model artifacts/default --data stdlib
    attnserve eval --ckpt checkpoints/default --data stdlib --json results/eval-torch.json
    attnserve eval --model ART --data notes.txt --max-tokens 8192 --window 512 --stride 256

Parser and handler only (export/evaluate.py computes): the root CLI registers this parser
even where numpy and torch are not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "eval", help="perplexity and bits per byte of an artifact or checkpoint on a text",
        description="Sliding-window perplexity (Hugging Face's rule: each window scores the "
                    "tokens the previous one did not, with the earlier tokens as context) of "
                    "an ONNX artifact (model.onnx in ONNX Runtime) or a checkpoint (PyTorch) "
                    "over the same token ids, so fp32, int8 and the checkpoint compare "
                    "directly. Prints the result as JSON; progress goes to stderr.")
    p.add_argument("--model", metavar="ARTIFACT_DIR", help="artifact directory (model.onnx)")
    p.add_argument("--ckpt", metavar="CHECKPOINT_DIR", help="checkpoint directory (PyTorch)")
    p.add_argument("--data", default="stdlib", metavar="FILE|stdlib",
                   help="UTF-8 text file (documents may be separated by lines holding only "
                        "<end>), or 'stdlib': the held-out last 10%% of the built-in corpus "
                        "(default)")
    p.add_argument("--max-tokens", type=int, default=4096, metavar="N",
                   help="evaluate the first N tokens of the text (default 4096)")
    p.add_argument("--window", type=int, default=None, metavar="W",
                   help="tokens per forward pass (default: the model's context, at most 512)")
    p.add_argument("--stride", type=int, default=None, metavar="S",
                   help="tokens between window starts; each window scores the last S "
                        "(default: W // 2)")
    p.add_argument("--json", default=None, metavar="OUT",
                   help="also write the result to this file (atomically)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, metavar="N",
                   help="intra-op threads for ONNX Runtime or PyTorch (default: all cores)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Check everything cheap first: a bad argument loads no weights and writes nothing."""
    if (args.model is None) == (args.ckpt is None):
        raise ValueError("give exactly one of --model ARTIFACT_DIR and --ckpt CHECKPOINT_DIR")
    if args.max_tokens < 2:
        raise ValueError(f"--max-tokens must be at least 2, got {args.max_tokens}")
    if args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    from export.evaluate import (
        artifact_backend,
        checkpoint_backend,
        evaluate,
        load_text,
        resolve_window,
    )

    # reads config.json only; the window and stride are judged against its context
    backend = artifact_backend(args.model) if args.model else checkpoint_backend(args.ckpt)
    window, stride = resolve_window(args.window, args.stride, backend.context)
    text, source = load_text(args.data)
    if backend.name == "torch":
        import torch

        torch.set_num_threads(args.threads)
    result = evaluate(backend, text, source, max_tokens=args.max_tokens, window=window,
                      stride=stride, threads=args.threads, progress=not args.no_progress)
    out = json.dumps(result, indent=2)
    if args.json:
        from model.data import write_text_atomic

        write_text_atomic(Path(args.json), out + "\n")
    print(out)
    sys.stdout.flush()
    return 0
