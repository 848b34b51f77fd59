"""model.onnx behind the ModelRunner protocol, its cache held in the same KV pool.

model.onnx is the portable graph of the ONNX I/O contract (service/contract/io_spec.py):
it takes the past as (B, nkv, T_past, hs) tensors and returns a present one step longer,
so it cannot write into the pool in place as engine.onnx does. This runner gathers each
row's cached keys and values from its pool slot into a left-padded past every pass and
writes only the new columns back: a copy of the batch's cache per step, the price of the
portable graph (it runs where engine.onnx does not: under CUDA, or for an artifact
exported without engine.onnx). Under CUDA the past goes to the device and the presents
come back on every pass.

Left padding is what the contract specifies: ``attention_mask`` marks the real columns
and ``position_ids`` count each row's own tokens, so padding changes nothing a row
computes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from service.contract import io_spec as io
from service.engine.kv_pool import Slot
from service.engine.pooled import PooledRunner
from service.engine.runner import PoolConfig
from service.engine.session import CUDA


class ModelGraphRunner(PooledRunner):
    """ModelRunner over model.onnx: the past gathered from the pool, the new columns put back."""

    def __init__(self, session: ort.InferenceSession, config: io.ArtifactConfig,
                 pool: PoolConfig) -> None:
        n = config.n_layers
        inputs = {i.name for i in session.get_inputs()}
        outputs = {o.name for o in session.get_outputs()}
        missing = sorted(({*io.model_input_names(n)} - inputs)
                         | ({*io.model_output_names(n)} - outputs))
        if missing:
            raise ValueError(f"model.onnx does not follow the I/O contract: missing {missing}")
        super().__init__(config, pool, np.dtype(config.kv_dtype))
        self.session = session
        self.graph_file = io.MODEL_FILE
        self.provider = session.get_providers()[0]
        self.device = "cuda" if self.provider == CUDA else "cpu"
        self._past = io.past_names(n)
        self._outputs = io.model_output_names(n)

    def _run(self, ids: np.ndarray, mask: np.ndarray, pos: np.ndarray,
             past: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        """logits (B, T, V) and presents (B, nkv, T_past + T, hs)."""
        feed = {io.INPUT_IDS: ids, io.ATTENTION_MASK: mask, io.POSITION_IDS: pos}
        feed.update(zip(self._past, past, strict=True))
        outs = self.session.run(self._outputs, feed)
        return outs[0], outs[1:]

    def _gather(self, index: np.ndarray, lengths: np.ndarray
                ) -> tuple[list[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Each row's cached columns, left-padded to the longest: one (B, nkv, P, hs) past per
        array, and the (row, pool column, past column) index of every cached token."""
        b, width = len(index), int(lengths.max()) if len(lengths) else 0
        rows = np.repeat(np.arange(b), lengths)  # (N,) over all cached tokens
        src = np.arange(len(rows)) - np.repeat(np.cumsum(lengths) - lengths, lengths)  # (N,)
        dst = src + np.repeat(width - lengths, lengths)  # (N,) right-aligned at the end
        shape = (b, self.shape.heads, width, self.shape.head_dim)
        past = []
        for array in self.pool.arrays:  # each (S, nkv, M, hs)
            p = np.zeros(shape, self.shape.dtype)  # (B, nkv, P, hs)
            if len(rows):
                p[rows, :, dst] = array[index[rows], :, src]  # (N, nkv, hs)
            past.append(p)
        return past, (rows, src, dst)

    def decode(self, slots: Sequence[Slot], tokens: np.ndarray) -> np.ndarray:
        b = len(slots)
        index = np.fromiter((s.index for s in slots), np.int64, b)  # (B,)
        lengths = self.pool.lengths[index]  # (B,) a copy
        width = int(lengths.max())
        self._check_room(width + 1)
        past, _ = self._gather(index, lengths)
        mask = (np.arange(width + 1)[None, :] >= (width - lengths)[:, None]).astype(np.int64)
        ids = np.asarray(tokens, np.int64)[:, None]  # (B, 1)
        logits, present = self._run(ids, mask, lengths[:, None].astype(np.int64), past)
        for array, new in zip(self.pool.arrays, present, strict=True):
            array[index, :, lengths] = new[:, :, width]  # (B, nkv, hs): the new column
        self.pool.tokens[index, lengths] = ids[:, 0]
        self.pool.lengths[index] = lengths + 1
        return np.asarray(logits[:, -1])  # (B, V)

    def _prefill_rows(self, slots: Sequence[Slot], prompts: Sequence[np.ndarray],
                      all_logits: bool) -> list[np.ndarray]:
        b = len(slots)
        index = np.fromiter((s.index for s in slots), np.int64, b)  # (B,)
        lengths = np.fromiter((len(p) for p in prompts), np.int64, b)  # (B,)
        width = int(lengths.max())
        self._check_room(width)
        ids = np.zeros((b, width), np.int64)  # (B, W) left-padded
        mask = np.zeros((b, width), np.int64)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = p
            mask[i, width - len(p):] = 1
        pos = np.clip(mask.cumsum(axis=1) - 1, 0, None)  # (B, W)
        empty = np.zeros((b, self.shape.heads, 0, self.shape.head_dim), self.shape.dtype)
        logits, present = self._run(ids, mask, pos, [empty] * len(self._past))
        rows = np.repeat(np.arange(b), lengths)  # (N,)
        src = np.arange(len(rows)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        dst = src + np.repeat(width - lengths, lengths)
        for array, new in zip(self.pool.arrays, present, strict=True):
            array[index[rows], :, src] = new[rows, :, dst]  # (N, nkv, hs)
        for s, p in zip(slots, prompts, strict=True):
            self._record(s.index, 0, p)
        return [logits[i, width - n:] if all_logits else logits[i, width - 1:]
                for i, n in enumerate(lengths.tolist())]

    def extend(self, slot: Slot, tokens: np.ndarray) -> np.ndarray:
        start = int(self.pool.lengths[slot.index])
        total = start + len(tokens)
        self._check_room(total)
        past = [np.ascontiguousarray(a[slot.index:slot.index + 1, :, :start])
                for a in self.pool.arrays]  # each (1, nkv, L, hs)
        ids = np.asarray(tokens, np.int64)[None, :]  # (1, T)
        mask = np.ones((1, total), np.int64)
        pos = np.arange(start, total, dtype=np.int64)[None, :]
        logits, present = self._run(ids, mask, pos, past)
        for array, new in zip(self.pool.arrays, present, strict=True):
            array[slot.index, :, start:total] = new[0, :, start:]  # (nkv, T, hs)
        self._record(slot.index, start, tokens)
        return np.asarray(logits[0])  # (T, V)
