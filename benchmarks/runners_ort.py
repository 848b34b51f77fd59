"""Generation loops on ONNX Runtime alone (no torch in these worker processes).

``PlainORT`` is what a user following the Optimum convention writes by hand: feed
``present.*`` back as ``past_key_values.*`` every step, the cache crossing the Python
boundary (and being re-concatenated inside the graph) each time. ``greedy_agreement``
scores the int8 artifact against the fp32 one with the project's one agreement metric.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.measure import GenResult
from service.contract import io_spec as io


def ort_session(model_path: Path, threads: int) -> Any:
    from service.contract.sessions import create_session

    return create_session(model_path, threads=threads)


class PlainORT:
    """A greedy loop over model.onnx driven by the I/O names of the contract only."""

    name = "ort_plain"

    def __init__(self, artifact_dir: Path, threads: int) -> None:
        self.config = io.ArtifactConfig.load(artifact_dir)
        self.session = ort_session(artifact_dir / io.MODEL_FILE, threads)
        self.kv_dtype = np.float16 if self.config.kv_dtype == "float16" else np.float32
        self.past_names = io.past_names(self.config.n_layers)
        self.output_names = io.model_output_names(self.config.n_layers)

    def _empty_past(self, batch: int) -> dict[str, np.ndarray]:
        c = self.config
        shape = (batch, c.n_heads, 0, c.head_dim)  # (B, nh, 0, hs)
        return {n: np.zeros(shape, dtype=self.kv_dtype) for n in self.past_names}

    def generate(self, prompts: list[list[int]], n_new: int) -> GenResult:
        t0 = time.perf_counter()
        ids = np.asarray(prompts, dtype=np.int64)  # (B, T)
        b, t = ids.shape
        feed: dict[str, np.ndarray] = {
            io.INPUT_IDS: ids,
            io.ATTENTION_MASK: np.ones((b, t), dtype=np.int64),
            io.POSITION_IDS: np.tile(np.arange(t, dtype=np.int64), (b, 1)),
            **self._empty_past(b),
        }
        out: list[np.ndarray] = []
        ttft = 0.0
        length = t
        for step in range(n_new):
            logits, *present = self.session.run(self.output_names, feed)  # (B, T, V)
            nxt = logits[:, -1].argmax(-1).astype(np.int64)  # (B,)
            out.append(nxt)
            if step == 0:
                ttft = time.perf_counter() - t0
            feed = {
                io.INPUT_IDS: nxt[:, None],  # (B, 1)
                io.ATTENTION_MASK: np.ones((b, length + 1), dtype=np.int64),
                io.POSITION_IDS: np.full((b, 1), length, dtype=np.int64),
                **dict(zip(self.past_names, present, strict=True)),
            }
            length += 1
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
