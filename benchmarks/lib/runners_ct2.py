"""CTranslate2 on the transformers copy: converted once per compute type, greedy decode.

CTranslate2's ``Generator`` takes token strings, so ids are mapped through the converted
model's own vocabulary (the same 50,257 entries as the tokenizer). The prompt is
forwarded at once (``include_prompt_in_result=False``), ``min_length`` keeps
end-of-sequence from stopping a row early, and a step callback timestamps the first
generated token (TTFT).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.measure import GenResult

COMPUTE_TYPES = {"ct2": "float32", "ct2_int8": "int8"}


def convert(hf_dir: Path, out_dir: Path, compute_type: str) -> dict[str, Any]:
    """TransformersConverter: float32 weights, or int8 ones stored for an int8 run."""
    import ctranslate2
    from ctranslate2.converters import TransformersConverter

    t0 = time.perf_counter()
    quantization = None if compute_type == "float32" else compute_type
    TransformersConverter(str(hf_dir)).convert(str(out_dir), quantization=quantization,
                                               force=True)
    return {"convert_s": time.perf_counter() - t0, "ctranslate2_version": ctranslate2.__version__,
            "quantization": quantization or "float32"}


def _vocabulary(model_dir: Path) -> list[str]:
    for name in ("vocabulary.json", "vocabulary.txt"):
        path = model_dir / name
        if path.is_file():
            if name.endswith(".json"):
                return list(json.loads(path.read_text("utf-8")))
            return path.read_text("utf-8").split("\n")[:-1]
    raise FileNotFoundError(f"{model_dir} has no vocabulary file")


class CT2Generator:
    """ctranslate2.Generator, greedy (sampling_topk=1), one thread pool of ``threads``."""

    def __init__(self, model_dir: Path, threads: int, compute_type: str = "float32",
                 name: str = "ct2") -> None:
        import ctranslate2

        self.name = name
        self.vocab = _vocabulary(model_dir)
        self.generator = ctranslate2.Generator(str(model_dir), device="cpu",
                                               compute_type=compute_type,
                                               intra_threads=threads, inter_threads=1)

    def generate(self, prompts: list[list[int]], n_new: int) -> GenResult:
        first: list[float] = []

        def on_step(step: Any) -> bool:
            if step.step == 0 and not first:
                first.append(time.perf_counter())
            return False  # keep going

        tokens = [[self.vocab[i] for i in p] for p in prompts]
        t0 = time.perf_counter()
        results = self.generator.generate_batch(
            tokens, max_length=n_new, min_length=n_new, sampling_topk=1, beam_size=1,
            include_prompt_in_result=False, callback=on_step)
        total = time.perf_counter() - t0
        out = [list(r.sequences_ids[0]) for r in results]
        return GenResult(out, (first[0] if first else t0 + total) - t0, total)
