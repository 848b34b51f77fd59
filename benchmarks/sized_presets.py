"""Sized presets: Llama 3.2 shapes at real sizes, random weights, as llama.cpp's own files.

Usage (from the repository root, in the dev venv; needs the llama.cpp tools,
``python -m benchmarks llamacpp-tools --build``):
    python -m benchmarks sized-presets --preset llama-1b     # f16, Q4_0, Q4_K_M (~3 min; 3b ~10)
    python -m benchmarks sized-presets --preset llama-3b --drop-hf
    python -m benchmarks sized-presets --list

Nothing can be downloaded, so a shape is built here: transformers makes a
``LlamaForCausalLM`` of the shape with its own initialisation (normal, σ = its
``initializer_range`` 0.02, RMSNorm weights 1; seed 0) directly in bfloat16, as Llama 3.2
ships, and saves it as a Hugging Face directory. llama.cpp's ``convert_hf_to_gguf.py``
writes the f16 file and ``llama-quantize`` makes Q4_0 and Q4_K_M from it: the files are
what a user of llama.cpp would make from a real checkpoint of that shape, so its kernels
and ours can be timed on the very same file.

The tokenizer is SmolLM2's (49,152 ids), rebuilt from the shipped SmolLM2-135M-Instruct
GGUF by the project's own GGUF import (model/gguf/vocab.py): it is a tokenizer the
converter recognises (pre-tokenizer ``smollm``), and engines are fed token ids, so only
the vocabulary size matters to speed. The shapes keep Llama 3.2's body and swap its
128,256-id vocabulary for SmolLM2's.

Files go to ``.cache/bench-work/sized/<preset>/``: ``hf/``, ``<preset>-f16.gguf``,
``<preset>-Q4_0.gguf``, ``<preset>-Q4_K_M.gguf`` and ``sized.json`` (shape, seed, the
commands, each file's size and sha256). A second call with the same recipe reuses them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.lib.measure import DEFAULT_THREADS, add_threads_option
from benchmarks.llamacpp_env import LLAMA_CPP_PYTHON
from benchmarks.llamacpp_tools import converter_command, run_logged, tool_path

REPO_ROOT = Path(__file__).resolve().parents[1]
SIZED_DIR = REPO_ROOT / ".cache" / "bench-work" / "sized"
SEED = 0
QUANTS = ("Q4_0", "Q4_K_M")
MANIFEST = "sized.json"


@dataclass(frozen=True)
class SizedShape:
    """The fields of a Llama config.json that shape the computation."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int = 49152  # SmolLM2's tokenizer (see above)
    rope_theta: float = 500000.0
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True  # as Llama 3.2 1B and 3B

    def hf_config(self) -> dict[str, Any]:
        return {**asdict(self), "hidden_act": "silu", "attention_bias": False,
                "mlp_bias": False, "head_dim": self.hidden_size // self.num_attention_heads}


# Every row width a multiple of 256, so llama-quantize keeps its k-quants on every matrix
# (a width that is not falls back to Q5_0 / Q5_1 / Q8_0).
SHAPES: dict[str, SizedShape] = {
    # meta-llama/Llama-3.2-1B's body: d 2048, 16 layers, 32 / 8 heads of 64, SwiGLU 8192.
    "llama-1b": SizedShape(2048, 16, 32, 8, 8192),
    # meta-llama/Llama-3.2-3B's body: d 3072, 28 layers, 24 / 8 heads of 128, SwiGLU 8192.
    "llama-3b": SizedShape(3072, 28, 24, 8, 8192),
    # For tests: two layers of d 256, 4 / 2 heads of 64, SwiGLU 512.
    "llama-tiny": SizedShape(256, 2, 4, 2, 512, max_position_embeddings=1024),
}


def write_smollm2_tokenizer(out: Path, context_length: int) -> dict[str, int | None]:
    """tokenizer.json and its side files, rebuilt from the shipped SmolLM2 GGUF; its ids."""
    from benchmarks.lib.smollm2_instruct_preset import source_gguf
    from model.gguf.reader import open_gguf, read_metadata
    from model.gguf.vocab import build_tokenizer, read_vocab, side_files

    gguf = source_gguf()
    vocab = read_vocab(read_metadata(open_gguf(gguf), gguf), str(gguf))
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(vocab).save(str(out / "tokenizer.json"))
    for name, data in side_files(vocab, context_length).items():
        (out / name).write_bytes(data)
    return {**vocab.special, "n_tokens": len(vocab.tokens)}


def build_hf_llama(shape: SizedShape, out: Path, seed: int = SEED) -> dict[str, Any]:
    """Random-weight Llama of ``shape`` as a Hugging Face directory (bf16 safetensors).

    One copy in memory: made in bfloat16 (3B: 6 GB, where float32 would take 12 GB) and
    freed before returning. A forward of a few tokens checks the logits are finite.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = write_smollm2_tokenizer(out, shape.max_position_embeddings)
    if ids["n_tokens"] != shape.vocab_size:
        raise ValueError(f"the tokenizer has {ids['n_tokens']} ids, the shape "
                         f"{shape.vocab_size}")
    config = LlamaConfig(**shape.hf_config(), bos_token_id=ids["bos_token_id"],
                         eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"])
    torch.manual_seed(seed)
    model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        probe = torch.arange(8).unsqueeze(0) * 997 % shape.vocab_size  # (1, 8)
        logits = model(probe).logits.float()  # (1, 8, V)
    if not bool(torch.isfinite(logits).all()):
        raise RuntimeError(f"random {shape} gives non-finite logits")
    model.save_pretrained(str(out), safe_serialization=True)
    params = int(model.num_parameters())
    del model
    return {"params": params, "logits_std": round(float(logits.std()), 4)}


def file_record(path: Path) -> dict[str, Any]:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            sha.update(chunk)
    return {"file": path.name, "bytes": path.stat().st_size, "sha256": sha.hexdigest()}


def convert_f16(hf: Path, out: Path) -> list[str]:
    """llama.cpp's converter, HF directory → f16 GGUF (written aside, then renamed)."""
    prefix, env = converter_command()
    part = out.with_name(out.name + ".part")
    cmd = [*prefix, str(hf), "--outfile", str(part), "--outtype", "f16"]
    run_logged(cmd, out.with_suffix(".log"), env, append=False)
    part.rename(out)
    return cmd


def quantize(f16: Path, out: Path, qtype: str, threads: int) -> list[str]:
    """``llama-quantize`` with its default mix for ``qtype`` (written aside, then renamed)."""
    part = out.with_name(out.name + ".part")
    cmd = [str(tool_path("llama-quantize")), str(f16), str(part), qtype, str(threads)]
    run_logged(cmd, out.with_suffix(".log"), append=False)
    part.rename(out)
    return cmd


def recipe(preset: str) -> dict[str, Any]:
    """What the files are made of; files made from another recipe are made again."""
    return {"preset": preset, "shape": SHAPES[preset].hf_config(), "seed": SEED,
            "dtype": "bfloat16", "tokenizer": "SmolLM2-135M-Instruct GGUF",
            "llama_cpp": LLAMA_CPP_PYTHON, "quants": list(QUANTS)}


def make_sized(preset: str, root: Path = SIZED_DIR, threads: int = DEFAULT_THREADS,
               keep_hf: bool = True, log: object = print) -> dict[str, Any]:
    """The f16, Q4_0 and Q4_K_M files of ``preset`` under ``root/preset``; the manifest."""
    if preset not in SHAPES:
        raise ValueError(f"unknown sized preset {preset!r}; one of {', '.join(SHAPES)}")
    work = root / preset
    manifest_path = work / MANIFEST
    want = recipe(preset)
    old: dict[str, Any] = {}
    if manifest_path.is_file():
        old = json.loads(manifest_path.read_text(encoding="utf-8"))
        if old.get("recipe") == want and all(
                (work / r["file"]).is_file() and (work / r["file"]).stat().st_size == r["bytes"]
                for r in old["files"].values()):
            return old
        if old.get("recipe") != want:  # another shape or tool: start over
            shutil.rmtree(work)
            old = {}
    work.mkdir(parents=True, exist_ok=True)
    say = log if callable(log) else (lambda _msg: None)
    hf, f16 = work / "hf", work / f"{preset}-f16.gguf"
    commands: dict[str, list[str]] = dict(old.get("commands", {}))
    model: dict[str, Any] = dict(old.get("model", {}))
    if not f16.is_file():
        if not (hf / "config.json").is_file():
            say(f"{preset}: building the random-weight Hugging Face model in {hf}")
            part = work / "hf.part"
            shutil.rmtree(part, ignore_errors=True)
            model = build_hf_llama(SHAPES[preset], part)
            part.rename(hf)
        say(f"{preset}: convert_hf_to_gguf.py → {f16.name}")
        commands["f16"] = convert_f16(hf, f16)
    files = {"f16": f16}
    for qtype in QUANTS:
        files[qtype] = work / f"{preset}-{qtype}.gguf"
        if not files[qtype].is_file():
            say(f"{preset}: llama-quantize {qtype} → {files[qtype].name}")
            commands[qtype] = quantize(f16, files[qtype], qtype, threads)
    if not keep_hf:
        shutil.rmtree(hf, ignore_errors=True)
    manifest = {"recipe": want, "model": model, "commands": commands,
                "files": {k: file_record(p) for k, p in files.items()}}
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks sized-presets", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(SHAPES), help="the shape to make")
    p.add_argument("--root", type=Path, default=SIZED_DIR, help=f"(default {SIZED_DIR})")
    add_threads_option(p, "llama-quantize threads")
    p.add_argument("--drop-hf", action="store_true",
                   help="delete the Hugging Face directory once the f16 file is written")
    p.add_argument("--list", action="store_true", help="print the shapes and exit")
    args = p.parse_args(argv)
    if args.list or args.preset is None:
        for name, shape in SHAPES.items():
            print(f"{name}: {json.dumps(asdict(shape))}")
        return 0
    try:
        manifest = make_sized(args.preset, args.root, args.threads, keep_hf=not args.drop_hf)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"sized_presets: error: {exc}", file=sys.stderr)
        return 2
    for kind, record in manifest["files"].items():
        print(f"{kind:7} {record['bytes'] / 2**20:9.1f} MiB  {record['sha256']}  "
              f"{args.root / args.preset / record['file']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
