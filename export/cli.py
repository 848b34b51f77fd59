"""`attnserve export` (checkpoint directory → verified ONNX artifact directory, Hugging Face
copy or GGUF file), `attnserve eval` (perplexity and bits per byte: export/verify/evaluate.py)
and `attnserve steer` (a control vector from prompt pairs: export/steer.py).

Usage:
    attnserve export --ckpt checkpoints/smollm2-135m-instruct --out artifacts/smollm2-135m-instruct
    attnserve export --ckpt CKPT --out ART --quantize int8 --engine-graph --force
    attnserve export --ckpt CKPT --out ART --dtype float16 --opset 20
    attnserve export --ckpt CKPT --out HF_DIR --format hf
    attnserve export --ckpt CKPT --out model.gguf --format gguf [--outtype q8_0]
    attnserve export --adapter ADAPTER --ckpt CKPT --out lora.gguf --format gguf
    attnserve export --ckpt CKPT --out ART --engine-graph   # + engine.onnx for the service
    attnserve eval --model artifacts/default --data stdlib
    attnserve eval --ckpt checkpoints/default --data stdlib --json results/eval-torch.json
    attnserve eval --model ART --data notes.txt --max-tokens 8192 --window 512 --stride 256
    attnserve steer --ckpt CKPT --pairs pairs.jsonl --out happy.gguf [--method mean]

Parsers and handlers only, nothing heavy imported at module level: the root CLI registers
these parsers even where numpy and torch are not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "export", help="export a checkpoint to ONNX (KV cache) and verify it against PyTorch",
        description="Export a checkpoint to an artifact directory: model.onnx (KV cache), "
                    "attention.onnx, tokenizer.json, config.json, manifest.json; or, with "
                    "--format hf, a Hugging Face directory; or, with --format gguf, a "
                    "llama.cpp GGUF file (for llama.cpp, ollama, LM Studio), of the model or, "
                    "with --adapter, of a LoRA adapter.")
    p.add_argument("--ckpt", required=True, help="checkpoint directory (config.json, "
                   "model.safetensors, tokenizer.json)")
    p.add_argument("--out", required=True, help="artifact directory to create")
    p.add_argument("--opset", type=int, default=None,
                   help="ONNX opset (default 18; supported 18-21)")
    p.add_argument("--quantize", choices=["int8", "int4", "int8-dynamic", "gguf"], default=None,
                   help="int8: block-quantised 8-bit MatMulNBits weights (block 32, int8 "
                        "activations; works with --engine-graph); int4: 4-bit MatMulNBits "
                        "(block 32, a zero point per block; works with --engine-graph); "
                        "int8-dynamic: ORT quantize_dynamic (per-channel weights, "
                        "int8 activations with a scale per row); gguf: a checkpoint "
                        "imported from GGUF keeps the file's own Q4_0/Q4_1/Q8_0 and K-quant "
                        "blocks (not requantised: GgufMatMul or MatMulNBits, --kernel; works "
                        "with --engine-graph), built from the file "
                        "without a float32 copy of the model when the checkpoint holds it")
    p.add_argument("--dtype", choices=["float32", "float16"], default="float32",
                   help="float16: the engine graphs' weights, activations and KV cache in float16 "
                        "for the CUDA provider; logits stay float32 (export/onnx/float16.py)")
    p.add_argument("--kv-dtype", choices=["float32", "float16"], default=None,
                   help="the engine graphs' KV cache. float16: with --quantize gguf --kernel "
                        "ggml --engine-graph at int8 activations, the CPU graphs' cache in "
                        "float16, half the pool's bytes and what a decode step reads of it (as "
                        "llama.cpp's f16 cache), model.onnx kept float32 "
                        "(export/gguf/half_cache.py). Default: float16 where the export can "
                        "write it, else --dtype's")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the parity checks against PyTorch (not recommended)")
    p.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--format", choices=["onnx", "hf", "gguf"], default="onnx",
                   help="onnx: the attnserve artifact; hf: a Hugging Face transformers model; "
                        "gguf: a llama.cpp file (--out FILE.gguf)")
    p.add_argument("--outtype", default=None,
                   choices=["f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0"],
                   help="with --format gguf: re-encode every matrix as this type (gguf's "
                        "own quantisers; the output head stays q8_0 under the 4- and 5-bit "
                        "ones); default: a checkpoint holding its GGUF file keeps "
                        "the file's blocks byte for byte, any other is written as f32 (an "
                        "adapter: f32, f16 or bf16)")
    p.add_argument("--adapter", default=None, metavar="DIR",
                   help="with --format gguf: write this PEFT LoRA adapter of --ckpt as "
                        "llama.cpp's adapter file (llama-server --lora FILE)")
    p.add_argument("--engine-graph", action="store_true",
                   help="also write engine.onnx: the service's own decoder graph "
                        "(GroupQueryAttention, KV cache updated in place); float32 or "
                        "--quantize int8/int4")
    p.add_argument("--no-mixed-steps", dest="mixed_steps", action="store_false",
                   help="with --engine-graph, leave out engine_mixed.onnx (the decoder "
                        "with a second group of rows, in which newcomers' prompts and prompt "
                        "chunks ride in the decode step; see docs/engine.md)")
    p.add_argument("--float32-twin", action="store_true",
                   help="with --engine-graph and --quantize int8/int4/gguf, also write "
                        "engine_float32.onnx: float32 weights for long prompt passes (4-bit: "
                        "20-29%% faster from about 200 tokens on SmolLM2, at 4 bytes a "
                        "weight; export prints the MB added)")
    p.add_argument("--activations", choices=["int8", "float"], default="int8",
                   help="with --quantize gguf: run the kept blocks at int8 activations "
                        "(as llama.cpp does; the fastest) or float ones: the float32 "
                        "model's answers, slower from a few rows (ggml: GgufMatMul keeps X "
                        "in float32; nbits: MatMulNBits level 0, 8-bit blocks as two 4-bit "
                        "products; docs/export.md)")
    p.add_argument("--kernel", choices=["nbits", "ggml", "auto"], default="auto",
                   help="with --quantize gguf: whose kernels compute the kept blocks. nbits: "
                        "ONNX Runtime's MatMulNBits (the blocks repacked with float32 "
                        "scales, Q5/Q6 pieces as 8-bit codes: about 1.4x the file); ggml: "
                        "the file's bytes as stored, computed by ggml's kernels inside ONNX "
                        "Runtime (the GgufMatMul op library, `make gguf-ops`; the weights "
                        "the file's size); auto (the default): ggml where the op library "
                        "is built, else nbits, said in one line (docs/kernels.md)")
    p.set_defaults(handler=run)
    _register_eval(subparsers)
    _register_steer(subparsers)


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    # PyTorch's OpenMP workers wait for work asleep rather than spinning (read once, when
    # torch loads; a setting of the user's stands): the export alternates PyTorch with
    # one-thread ONNX Runtime sessions, and on busy cores a spinning worker the system has
    # descheduled stalls every parallel region. SmolLM2's PyTorch checks, 2 threads on 2
    # loaded cores: 75 s spinning, 15 s asleep, the same logits bit for bit.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if args.format != "gguf" and (args.outtype or args.adapter):
        print("attnserve export: --outtype and --adapter apply to --format gguf",
              file=sys.stderr)
        return 2
    if args.format == "gguf":
        return _gguf(args, started)
    if args.format == "hf":
        from export.to_hf import export_hf

        export_hf(args.ckpt, args.out, args.force)
        print(f"exported {args.ckpt} → {args.out} (Hugging Face format)")
        return 0
    from export.to_onnx import export_artifact

    kernel = args.kernel
    if kernel == "auto":
        kernel = _auto_kernel(args.quantize)
    out = export_artifact(
        args.ckpt, args.out, opset=args.opset, dtype=args.dtype, quantize=args.quantize,
        verify=not args.no_verify, force=args.force,
        engine_graph=args.engine_graph, mixed_steps=args.mixed_steps,
        float32_twin=args.float32_twin, activations=args.activations, kernel=kernel,
        kv_dtype=args.kv_dtype,
        log=lambda msg: print(f"  [{time.perf_counter() - started:6.1f} s] {msg}",
                              file=sys.stderr))
    print(f"exported {args.ckpt} → {out} in {time.perf_counter() - started:.1f}s")
    return 0


def _auto_kernel(quantize: str | None) -> str:
    """--kernel auto: ggml for a GGUF file's blocks where the op library is built, else
    nbits, saying why in one line."""
    if quantize != "gguf":
        return "nbits"
    from service import ops

    if ops.library_path() is None:
        print("attnserve export: the GgufMatMul op library is not built here (make "
              "gguf-ops); the blocks go to ONNX Runtime's MatMulNBits (--kernel nbits)",
              file=sys.stderr)
        return "nbits"
    return "ggml"


def _gguf(args: argparse.Namespace, started: float) -> int:
    if args.adapter is not None:
        from export.gguf.adapter_file import export_gguf_adapter

        out = export_gguf_adapter(args.adapter, args.ckpt, args.out, args.outtype, args.force)
        print(f"exported adapter {args.adapter} (base {args.ckpt}) → {out} (llama.cpp LoRA) "
              f"in {time.perf_counter() - started:.1f}s")
        return 0
    from export.gguf.model_file import export_gguf

    out = export_gguf(args.ckpt, args.out, args.outtype, args.force,
                      log=lambda msg: print(f"  [{time.perf_counter() - started:6.1f} s] {msg}",
                                            file=sys.stderr))
    print(f"exported {args.ckpt} → {out} (GGUF, {out.stat().st_size / 2**20:,.1f} MiB) in "
          f"{time.perf_counter() - started:.1f}s")
    return 0


def _register_eval(subparsers: Any) -> None:
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
    p.set_defaults(handler=run_eval)


def run_eval(args: argparse.Namespace) -> int:
    """Check everything cheap first: a bad argument loads no weights and writes nothing."""
    if (args.model is None) == (args.ckpt is None):
        raise ValueError("give exactly one of --model ARTIFACT_DIR and --ckpt CHECKPOINT_DIR")
    if args.max_tokens < 2:
        raise ValueError(f"--max-tokens must be at least 2, got {args.max_tokens}")
    if args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    from export.verify.evaluate import (
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


def _register_steer(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "steer", help="a control vector (llama.cpp's GGUF) from contrastive prompt pairs",
        description="Make a control vector as llama.cpp's llama-cvector-generator does: the "
                    "hidden-state differences of each positive and negative prompt after "
                    "every layer but the last, reduced to one unit direction per layer, "
                    "written as llama.cpp's control-vector GGUF file (llama-server "
                    "--control-vector FILE). See docs/steering.md.")
    p.add_argument("--ckpt", required=True, help="checkpoint directory")
    p.add_argument("--pairs", required=True, metavar="FILE.jsonl",
                   help='one {"positive": "...", "negative": "..."} per line, prompts as '
                        "the model reads them (no chat template is applied)")
    p.add_argument("--out", required=True, metavar="VEC.gguf", help="control vector to write")
    p.add_argument("--method", choices=["pca", "mean"], default="pca",
                   help="pca (llama.cpp's default): the first principal component of the "
                        "differences; mean: their mean")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="PyTorch threads (default: PyTorch's)")
    p.set_defaults(handler=run_steer)


def run_steer(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    from export.steer import steer

    out = steer(args.ckpt, args.pairs, args.out, args.method, args.force)
    print(f"wrote {out} ({args.method}) from {args.pairs} in "
          f"{time.perf_counter() - started:.1f}s")
    return 0
