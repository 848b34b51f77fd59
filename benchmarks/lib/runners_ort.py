"""Generation loops on ONNX Runtime alone (no torch in these worker processes).

``PlainORT`` is what a user following the Optimum convention writes by hand: feed
``present.*`` back as ``past_key_values.*`` every step, the cache crossing the Python
boundary (and being re-concatenated inside the graph) each time. ``greedy_agreement``
scores the int8 artifact against the fp32 one with the project's one agreement metric.
"""

from __future__ import annotations

import time
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.lib.measure import GenResult


class PlainORT:
    """A greedy loop over model.onnx driven by the I/O names of the contract only: the
    contract's one greedy loop (service/contract/reference.py ``greedy_steps``), timed."""

    name = "ort_plain"

    def __init__(self, artifact_dir: Path, threads: int) -> None:
        from service.contract.reference import OrtDecoder

        self.decoder = OrtDecoder.from_artifact(artifact_dir, threads)

    def generate(self, prompts: list[list[int]], n_new: int) -> GenResult:
        from service.contract.reference import greedy_steps

        t0 = time.perf_counter()
        steps = greedy_steps(self.decoder, np.asarray(prompts, dtype=np.int64))  # (B, T)
        out = [next(steps)]  # (B,) each
        ttft = time.perf_counter() - t0
        out += islice(steps, n_new - 1)
        total = time.perf_counter() - t0
        return GenResult(np.stack(out, axis=1).tolist(), ttft, total)


def greedy_agreement(fp32_dir: Path, int8_dir: Path, prompts: list[list[int]],
                     new_tokens: int, threads: int) -> dict[str, Any]:
    """The int8 artifact scored against the fp32 one by the project's one agreement metric
    (service/contract/reference.py: teacher-forced greedy token agreement)."""
    from service.contract.reference import OrtDecoder, int8_agreement

    return int8_agreement(OrtDecoder.from_artifact(fp32_dir, threads),
                          OrtDecoder.from_artifact(int8_dir, threads),
                          np.asarray(prompts, np.int64), new_tokens)
