"""Two LoRA adapters made by PEFT over transformers for a tiny Llama, and their merged
models: what the adapter tests (engine and HTTP) check the served rows against.

The adapters are PEFT's own (random A and B: ``init_lora_weights=False``), never
attnserve's trainer; each reference is `attnserve merge` of the adapter into the
checkpoint, exported and run by the plain model.onnx loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from service.contract.adapter_spec import lora_file
from service.contract.engine_spec import ENGINE_MIXED_FILE
from service.contract.reference import OrtDecoder
from tests.conftest import torch_threads

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOL = 2e-4  # float32 logits of one graph against another's, summed in another order


@dataclass
class LoraBuild:
    """A tiny Llama with adapter graphs, two PEFT adapters and their merged models."""

    artifact: Path  # the base, with its adapter graphs
    adapters: dict[str, Path]  # name → PEFT adapter directory
    references: dict[str, OrtDecoder]  # "" (the base) and each name → its merged model
    merged: dict[str, Path]  # each name → its merged model's artifact


def peft_adapter(hf_dir: Path, out: Path, seed: int, rank: int, targets: list[str],
                 rslora: bool) -> Path:
    """A PEFT LoRA adapter with random A and B (PEFT's own init_lora_weights=False)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir))
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                        init_lora_weights=False, use_rslora=rslora)
    get_peft_model(model, config).save_pretrained(str(out))
    return out


def expected(build: LoraBuild, adapter: str, sequence: Sequence[int]) -> np.ndarray:
    """(T, V) logits of every position of ``sequence`` under the merged model, alone."""
    dec = build.references[adapter]
    ids = np.asarray([sequence], np.int64)
    logits, _ = dec(ids, np.ones_like(ids), np.arange(len(sequence))[None, :],
                    dec.empty_past(1))
    return logits[0]




def build_lora(build: Any, root: Path) -> LoraBuild:
    """Two PEFT adapters over the tiny Llama ``build`` (rank 8 on all seven projections;
    rank 4 on q and v with rsLoRA), each merged by `attnserve merge` and exported."""
    from export.to_onnx import export_artifact
    from model.finetune.merge import merge

    if not (build.artifact / lora_file(ENGINE_MIXED_FILE)).is_file():
        raise AssertionError("the llama artifact has no adapter graph")
    adapters = {
        "alpha": peft_adapter(build.hf_dir, root / "alpha", 1, 8, ALL, rslora=False),
        "beta": peft_adapter(build.hf_dir, root / "beta", 2, 4, ["q_proj", "v_proj"],
                             rslora=True)}
    references = {"": OrtDecoder.from_artifact(build.artifact)}
    artifacts: dict[str, Path] = {}
    with torch_threads(1):
        for name, directory in adapters.items():
            merged = merge(build.checkpoint, directory, root / f"{name}-merged")
            artifacts[name] = export_artifact(merged, root / f"{name}-artifact", verify=False)
            references[name] = OrtDecoder.from_artifact(artifacts[name])
    return LoraBuild(build.artifact, adapters, references, artifacts)


def held(adapters: Any, name: str) -> Any:
    """``name`` in an AdapterSet as a running request holds it: counted and in a slot."""
    ref = adapters.begin(name)
    assert adapters.acquire(ref)
    return ref




def greedy_until_tie(next_logits: Callable[[list[int]], np.ndarray], prompt: Sequence[int],
                     new: int) -> list[int]:
    """Up to ``new`` greedy tokens after ``prompt`` from ``next_logits`` (a sequence → its
    last position's (V,) logits), stopping at a near tie (top-2 margin below 1e-3: the
    model does not decide it, float order may flip it)."""
    seq, out = list(prompt), []
    for _ in range(new):
        logits = next_logits(seq)
        low, high = np.sort(logits)[-2:]
        if high - low < 1e-3:
            break
        out.append(int(logits.argmax()))
        seq.append(out[-1])
    return out


def merged_greedy(build: LoraBuild, adapter: str, prompt: Sequence[int], new: int
                  ) -> list[int]:
    """The merged model's (or the base's, adapter "") greedy tokens alone, up to a near tie."""
    return greedy_until_tie(lambda seq: expected(build, adapter, seq)[-1], prompt, new)
