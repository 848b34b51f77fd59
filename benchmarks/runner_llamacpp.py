"""llama.cpp through llama-cpp-python (runs only in the side env, benchmarks/llamacpp_env.py).

``quantize`` is llama.cpp's own quantiser (``llama_model_quantize``, what the
llama-quantize tool calls) turning the f32 GGUF into q8_0. ``LlamaCpp`` feeds token ids,
decodes greedily (temperature 0 → llama.cpp's greedy sampler) one sequence at a time —
llama-cpp-python serves a single sequence, so only batch 1 is measured — and ignores
end-of-sequence, as every runner here does.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks.measure import GenResult

FTYPES = {"q8_0": 7}  # LLAMA_FTYPE_MOSTLY_Q8_0


def quantize(src: Path, dst: Path, kind: str, threads: int) -> dict[str, Any]:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[kind]
    params.nthread = threads
    t0 = time.perf_counter()
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({kind}) failed with {rc}")
    return {"quantize_s": time.perf_counter() - t0, "bytes": dst.stat().st_size,
            "llama_cpp_python": llama_cpp.__version__}


class LlamaCpp:
    def __init__(self, gguf_path: Path, threads: int, n_ctx: int, name: str) -> None:
        from llama_cpp import Llama

        self.name = name
        self.llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=512,
                         n_threads=threads, n_threads_batch=threads, logits_all=False,
                         verbose=False)

    def generate(self, prompts: list[list[int]], n_new: int) -> GenResult:
        if len(prompts) != 1:
            raise ValueError("llama-cpp-python decodes one sequence at a time (batch 1)")
        out: list[int] = []
        t0 = time.perf_counter()
        ttft = 0.0
        for token in self.llm.generate(prompts[0], top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                       repeat_penalty=1.0, reset=True):
            if not out:
                ttft = time.perf_counter() - t0
            out.append(int(token))
            if len(out) == n_new:
                break
        total = time.perf_counter() - t0
        return GenResult([out], ttft, total)
