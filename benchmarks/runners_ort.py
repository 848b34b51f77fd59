"""Generation loops on ONNX Runtime alone (no torch in these worker processes).

``PlainORT`` is what a user following the Optimum convention writes by hand: feed
``present.*`` back as ``past_key_values.*`` every step, the cache crossing the Python
boundary (and being re-concatenated inside the graph) each time. ``greedy_agreement``
scores the int8 artifact against the fp32 one under teacher forcing.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.measure import GenResult
from service.contract import io_spec as io


def ort_session(model_path: Path, threads: int) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])


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


def _teacher_forced_argmax(session: Any, config: io.ArtifactConfig,
                           seqs: np.ndarray) -> np.ndarray:
    b, t = seqs.shape
    kv_dtype = np.float16 if config.kv_dtype == "float16" else np.float32
    empty = np.zeros((b, config.n_heads, 0, config.head_dim), dtype=kv_dtype)
    feed = {io.INPUT_IDS: seqs, io.ATTENTION_MASK: np.ones((b, t), dtype=np.int64),
            io.POSITION_IDS: np.tile(np.arange(t, dtype=np.int64), (b, 1)),
            **{n: empty for n in io.past_names(config.n_layers)}}
    (logits,) = session.run([io.LOGITS], feed)  # (B, T, V)
    return np.asarray(logits.argmax(-1))  # (B, T)


def greedy_agreement(fp32_dir: Path, int8_dir: Path, prompts: list[list[int]],
                     fp32_tokens: list[list[int]], threads: int) -> dict[str, Any]:
    """Share of positions where int8 picks fp32's greedy token, given fp32's own prefix.

    Teacher forcing keeps one early disagreement from counting every later token as
    wrong; the free-running figure (tokens equal before the first divergence) is reported
    beside it.
    """
    seqs = np.asarray([p + g for p, g in zip(prompts, fp32_tokens, strict=True)],
                      dtype=np.int64)  # (B, T + N)
    t = len(prompts[0])
    picks = {}
    for name, path in (("fp32", fp32_dir), ("int8", int8_dir)):
        session = ort_session(path / io.MODEL_FILE, threads)
        picks[name] = _teacher_forced_argmax(session, io.ArtifactConfig.load(path), seqs)
    # Positions t-1 .. T+N-2 predict the N generated tokens.
    fp32_pred = picks["fp32"][:, t - 1:-1]
    int8_pred = picks["int8"][:, t - 1:-1]
    target = seqs[:, t:]
    return {
        "positions": int(target.size),
        "fp32_reproduces_its_greedy": float((fp32_pred == target).mean()),
        "int8_teacher_forced_agreement": float((int8_pred == target).mean()),
    }
