"""Random PEFT LoRA adapters for an artifact: what the LoRA benchmarks serve.

Usage (from the repository root, in the dev venv):
    python -m benchmarks lora-adapters --model artifacts/smollm2-135m-instruct-lora \\
        --out adapters/bench --count 4 --rank 16

Writes ``--count`` adapters (``OUT/lora0``, ``OUT/lora1`` ...), each a PEFT directory
(adapter_config.json, adapter_model.safetensors) of rank ``--rank`` on every module the
artifact's adapter graph (engine_mixed_lora.onnx) takes: for a Llama-shaped model the
seven projections q, k, v, o, gate, up and down of every layer. The widths come from the
graph's inputs (service/contract/adapter_spec.py), so an adapter always fits the model.

The values look like a fine-tuned adapter's: A is drawn as PEFT initialises it
(``kaiming_uniform_(a=√5)``: uniform in ±1/√in), B, which PEFT starts at zero and training
moves, is normal with a small standard deviation (``--b-std``, default 0.02), lora_alpha is
twice the rank (the common r 16, alpha 32). On SmolLM2-135M-Instruct at rank 16, greedy
chat answers under such an adapter part from the base's on about half of short questions
and stay readable; at 0.01 they seldom part, from 0.04 they start to garble.
Each adapter is written into a temporary directory beside its destination and renamed into
place, so a reader never sees half an adapter.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from service.contract import adapter_spec
from service.contract.peft_adapter import CONFIG_FILE, KEY_PREFIX, WEIGHTS_FILE

ADAPTER_GRAPH = adapter_spec.lora_file("engine_mixed.onnx")
DEFAULT_B_STD = 0.02


def adapter_widths(artifact: Path) -> dict[str, tuple[int, int]]:
    """Module → (in, out) of every module the artifact's adapter graph takes, read from the
    graph's input shapes (its weights, in weights.bin, are not loaded)."""
    import onnx

    path = artifact / ADAPTER_GRAPH
    if not path.is_file():
        raise ValueError(f"{artifact} has no adapter graph ({ADAPTER_GRAPH}): export it again "
                         "with `attnserve export --engine-graph`")
    graph = onnx.load(str(path), load_external_data=False).graph
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
    modules = adapter_spec.adapter_modules(list(shapes))
    return {m: (shapes[adapter_spec.lora_a(m)][1], shapes[adapter_spec.lora_b(m)][1])
            for m in modules}


def adapter_tensors(widths: dict[str, tuple[int, int]], rank: int, b_std: float,
                    rng: np.random.Generator) -> dict[str, np.ndarray]:
    """PEFT's safetensors keys → A (r, in) uniform in ±1/√in, B (out, r) normal(0, b_std)."""
    tensors = {}
    for module, (width_in, width_out) in widths.items():
        key = f"{KEY_PREFIX}{module}"
        bound = 1.0 / np.sqrt(width_in)  # kaiming_uniform_(a=√5): gain √(1/3) · √(3/in)
        tensors[f"{key}.lora_A.weight"] = rng.uniform(
            -bound, bound, (rank, width_in)).astype(np.float32)
        tensors[f"{key}.lora_B.weight"] = rng.normal(
            0.0, b_std, (width_out, rank)).astype(np.float32)
    return tensors


def adapter_config(widths: dict[str, tuple[int, int]], rank: int, alpha: float,
                   base_model: str | None) -> dict[str, object]:
    """PEFT's adapter_config.json for plain LoRA on every module of ``widths``."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "use_dora": False,
            "fan_in_fan_out": False, "init_lora_weights": True,
            "target_modules": sorted({m.rsplit(".", 1)[-1] for m in widths}),
            "base_model_name_or_path": base_model}


def write_adapter(directory: Path, widths: dict[str, tuple[int, int]], rank: int,
                  alpha: float | None = None, b_std: float = DEFAULT_B_STD, seed: int = 0,
                  base_model: str | None = None, force: bool = False) -> Path:
    """One random adapter at ``directory``, written beside it and renamed into place
    (``force``: an existing directory is replaced; else FileExistsError)."""
    from safetensors.numpy import save_file

    if rank < 1 or b_std < 0:
        raise ValueError("--rank must be ≥ 1 and --b-std ≥ 0")
    if directory.exists() and not force:
        raise FileExistsError(f"{directory} exists (--force replaces it)")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        config = adapter_config(widths, rank, 2.0 * rank if alpha is None else alpha,
                                base_model)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", "utf-8")
        save_file(adapter_tensors(widths, rank, b_std, np.random.default_rng(seed)),
                  str(tmp / WEIGHTS_FILE))
        # mkdtemp's 0700 (and safetensors' 0600) would hide it from a server run as another user
        os.chmod(tmp, 0o755)
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            os.chmod(tmp / name, 0o644)
        if directory.exists():  # --force: the old one out of the way, then the new one in
            old = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old.", dir=directory.parent))
            os.replace(directory, old / directory.name)
            os.replace(tmp, directory)
            shutil.rmtree(old)
        else:
            os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def write_adapters(artifact: Path, out: Path, count: int, rank: int, alpha: float | None = None,
                   b_std: float = DEFAULT_B_STD, seed: int = 0, prefix: str = "lora",
                   force: bool = False) -> list[Path]:
    """``count`` adapters ``OUT/<prefix>0`` ... for ``artifact``, adapter k from seed + k."""
    widths = adapter_widths(artifact)
    return [write_adapter(out / f"{prefix}{k}", widths, rank, alpha, b_std, seed + k,
                          str(artifact), force) for k in range(count)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks lora-adapters",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True,
                        help="artifact with the adapter graph (engine_mixed_lora.onnx)")
    parser.add_argument("--out", type=Path, required=True, help="directory of the adapters")
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=None, help="lora_alpha (default 2·rank)")
    parser.add_argument("--b-std", type=float, default=DEFAULT_B_STD,
                        help=f"standard deviation of B (default {DEFAULT_B_STD})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefix", default="lora", help="names: PREFIX0, PREFIX1 ...")
    parser.add_argument("--force", action="store_true", help="replace existing adapters")
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error("--count must be ≥ 1")
    try:
        paths = write_adapters(args.model, args.out, args.count, args.rank, args.alpha,
                               args.b_std, args.seed, args.prefix, args.force)
    except (ValueError, OSError) as exc:
        print(f"benchmarks.lora_adapters: error: {exc}", file=sys.stderr)
        return 2
    size = (paths[0] / WEIGHTS_FILE).stat().st_size
    print(f"wrote {len(paths)} adapters of rank {args.rank} ({size / 2**20:.1f} MiB each): "
          + " ".join(f"{p.name}={p}" for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
