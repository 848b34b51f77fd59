"""The greedy reference over model.onnx, and the one int8 agreement metric.

A plain decode loop driven only by the contract's graph names (batch of equal-length
prompts, the whole past fed back every step): no engine code, no torch. Export checks
the int8 graph with it, the benchmark scores the int8 artifact with it, and the service
tests use it as the independent reference the engine must reproduce.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from service.contract import io_spec as io
from service.contract.sessions import create_session


def np_kv_dtype(kv_dtype: io.KvDtype) -> type[np.floating[Any]]:
    return np.float16 if kv_dtype == "float16" else np.float32


class Decoder(Protocol):
    """What the greedy loop drives: model.onnx (:class:`OrtDecoder`) or an engine graph
    behind the same call (export/verify/engine_parity.py ``EngineDecoder``); the past is opaque."""

    def empty_past(self, batch: int) -> Any: ...

    def __call__(self, ids: np.ndarray, mask: np.ndarray, pos: np.ndarray,
                 past: Any) -> tuple[np.ndarray, Any]: ...


@dataclass
class OrtDecoder:
    """model.onnx behind the contract names: call with ids/mask/positions and the past."""

    sess: Any  # onnxruntime.InferenceSession
    n_layers: int
    kv_heads: int  # heads of the cache: num_key_value_heads under grouped-query attention
    head_dim: int
    kv_dtype: io.KvDtype = "float32"

    @classmethod
    def from_file(cls, path: str | Path, n_layers: int, kv_heads: int, head_dim: int,
                  kv_dtype: io.KvDtype = "float32", threads: int = 1) -> OrtDecoder:
        return cls(create_session(path, threads=threads), n_layers, kv_heads, head_dim,
                   kv_dtype)

    @classmethod
    def from_artifact(cls, artifact_dir: str | Path, threads: int = 1) -> OrtDecoder:
        c = io.ArtifactConfig.load(artifact_dir)
        return cls.from_file(Path(artifact_dir) / io.MODEL_FILE, c.n_layers, c.kv_heads,
                             c.head_dim, c.kv_dtype, threads)

    def empty_past(self, batch: int) -> list[np.ndarray]:
        shape = (batch, self.kv_heads, 0, self.head_dim)  # (B, nkv, 0, hs)
        return [np.zeros(shape, np_kv_dtype(self.kv_dtype)) for _ in range(2 * self.n_layers)]

    def __call__(self, ids: np.ndarray, mask: np.ndarray, pos: np.ndarray,
                 past: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        feed = {io.INPUT_IDS: ids, io.ATTENTION_MASK: mask, io.POSITION_IDS: pos}
        feed.update(zip(io.past_names(self.n_layers), past, strict=True))
        outs = self.sess.run(io.model_output_names(self.n_layers), feed)
        return outs[0], outs[1:]  # logits (B, T, V); presents (B, nkv, T_past + T, hs)


def decode_steps(dec: Decoder, prompts: np.ndarray | Sequence[Sequence[int]],
                 forced: np.ndarray | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The one greedy loop: prompts through the KV cache, the whole past fed back every
    step; yields each step's logits (B, V) and their argmax (B,), for as long as the
    caller reads. Prompts of different lengths are right-padded: each row's first choice
    is read at its own last token and its later tokens go at its own length (the padding
    stays masked). With ``forced`` (B, steps), those tokens are fed instead of the argmax
    (teacher forcing); what is yielded is still the argmax."""
    lengths = np.array([len(p) for p in prompts], np.int64)  # (B,)
    b, t = len(lengths), int(lengths.max())
    ids = np.zeros((b, t), np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt)] = prompt
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.int64)  # (B, T)
    pos = np.broadcast_to(np.arange(t, dtype=np.int64), (b, t)).copy()
    logits, past = dec(ids, mask, pos, dec.empty_past(b))
    last = logits[np.arange(b), lengths - 1]  # (B, V): each row's own last token
    pos = lengths[:, None]  # (B, 1): where each row's next token goes
    step = 0
    while True:
        chosen = last.argmax(-1).astype(np.int64)  # (B,)
        yield last, chosen
        nxt = (forced[:, step] if forced is not None else chosen)[:, None]  # (B, 1)
        mask = np.concatenate([mask, np.ones((b, 1), np.int64)], axis=1)  # (B, T_past + 1)
        logits, past = dec(nxt, mask, pos, past)
        last = logits[:, -1]
        pos = pos + 1
        step += 1


def greedy_steps(dec: Decoder, prompts: np.ndarray | Sequence[Sequence[int]],
                 forced: np.ndarray | None = None) -> Iterator[np.ndarray]:
    """:func:`decode_steps`' argmax (B,) of each step."""
    return (chosen for _, chosen in decode_steps(dec, prompts, forced))


def greedy(dec: Decoder, prompts: np.ndarray | Sequence[Sequence[int]], steps: int,
           forced: np.ndarray | None = None) -> np.ndarray:
    """Greedy decode of prompts (B, T), or of any lengths (:func:`greedy_steps`): the argmax
    of ``steps`` steps (B, steps)."""
    chosen = np.zeros((len(prompts), steps), np.int64)
    for step, tokens in enumerate(islice(greedy_steps(dec, prompts, forced), steps)):
        chosen[:, step] = tokens
    return chosen


def greedy_until(dec: Decoder, prompt: list[int], max_new: int,
                 eos_token_id: int | None) -> list[int]:
    """One prompt, greedy, stopping after ``max_new`` tokens or right after end-of-sequence
    (the engine's stopping rule)."""
    out: list[int] = []
    for tokens in islice(greedy_steps(dec, np.asarray([prompt], np.int64)), max_new):
        out.append(int(tokens[0]))
        if out[-1] == eos_token_id:
            break
    return out


def int8_agreement(reference: Decoder, candidate: Decoder, prompts: np.ndarray,
                   steps: int) -> dict[str, Any]:
    """How often ``candidate`` (int8) picks ``reference``'s (fp32) greedy token.

    ``token_agreement`` is teacher-forced: the candidate is fed the reference's tokens, so
    one early divergence does not count every later token as wrong. The free-running figure
    (tokens equal before the first divergence, averaged over prompts) is reported beside it.
    """
    return agreement_with(candidate, prompts, greedy(reference, prompts, steps))


def agreement_with(candidate: Decoder, prompts: np.ndarray,
                   expected: np.ndarray) -> dict[str, Any]:
    """:func:`int8_agreement` given the reference's greedy tokens ``expected`` (P, steps),
    so that the reference's session can be gone before the candidate's is made."""
    steps = expected.shape[1]
    forced = greedy(candidate, prompts, steps, forced=expected)
    free = greedy(candidate, prompts, steps)
    common = [int(np.argmin(np.append(f == e, False))) for f, e in zip(free, expected,
                                                                      strict=True)]
    return {"prompts": int(prompts.shape[0]), "steps": steps, "positions": int(expected.size),
            "token_agreement": float((forced == expected).mean()),
            "free_running_mean_common_prefix": float(np.mean(common))}
