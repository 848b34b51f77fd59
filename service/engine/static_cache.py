"""engine.onnx behind the ModelRunner protocol: the KV pool's slots written in place.

model.onnx returns a new, one-column-longer present for every layer at every step
(Concat of past and new). engine.onnx instead takes one preallocated cache per layer,
(B, nh, max_seq_len, hs), as both past and present, and its GroupQueryAttention writes
the new keys and values into it in place. Here that cache is a run of slots of the
runner's KVPool (service/engine/kv_pool.py), bound by pointer: nothing is allocated per
request and nothing is copied per step.

Each row's tokens start at column 0 of its slot and the pool's ``lengths`` say how many
are cached, which is what the kernel reads (``seqlens_k``); inputs are right-padded. A
batch's rows must sit in consecutive slots: joining compacts them, and a leave moves at
most one row (``KVPool.compact``). Rows with empty slots are prefilled together
(GroupQueryAttention's first-prompt mode); a multi-token step over a non-empty cache
(a reused prefix, a prompt chunk, drafted tokens) runs one row at a time, as ONNX
Runtime supports it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from service.contract import engine_spec as es
from service.contract import io_spec as io
from service.engine.kv_pool import Slot
from service.engine.pooled import PooledRunner
from service.engine.runner import PoolConfig


class EngineGraphRunner(PooledRunner):
    """ModelRunner over engine.onnx with a persistent float32 KV pool on the host."""

    def __init__(self, session: ort.InferenceSession, config: io.ArtifactConfig,
                 pool: PoolConfig) -> None:
        n = config.n_layers
        inputs = {i.name for i in session.get_inputs()}
        outputs = {o.name for o in session.get_outputs()}
        missing = sorted(({*es.engine_input_names(n)} - inputs)
                         | ({*es.engine_output_names(n)} - outputs))
        if missing:
            raise ValueError(f"{es.ENGINE_FILE} lacks {missing}")
        super().__init__(config, pool, np.dtype(np.float32))
        self.session = session
        self.graph_file = es.ENGINE_FILE
        self.provider = session.get_providers()[0]
        self.device = "cpu"
        self._past, self._present = io.past_names(n), io.present_names(n)

    def _arrange(self, slots: Sequence[Slot], start: int | None) -> None:
        self.pool.compact(slots, start)

    def _run(self, lo: int, ids: np.ndarray, pos: np.ndarray, seqlens: np.ndarray,
             total: int) -> np.ndarray:
        """One pass over slots [lo, lo + n): ids/pos (n, T) right-padded; logits (n, T, V)."""
        n = ids.shape[0]
        binding = self.session.io_binding()
        binding.bind_output(io.LOGITS, "cpu")
        binding.bind_cpu_input(io.INPUT_IDS, np.ascontiguousarray(ids, np.int64))
        binding.bind_cpu_input(io.POSITION_IDS, np.ascontiguousarray(pos, np.int64))
        binding.bind_cpu_input(es.SEQLENS_K, seqlens.astype(np.int32))  # (n,) total − 1
        binding.bind_cpu_input(es.TOTAL_SEQUENCE_LENGTH, np.array([total], np.int32))
        shape = [n, self.shape.heads, self.max_len, self.shape.head_dim]
        for past, present, ptr in zip(self._past, self._present, self.pool.pointers(lo),
                                      strict=True):
            # The same memory as past and present: the kernel writes in place.
            binding.bind_input(past, "cpu", 0, np.float32, shape, ptr)
            binding.bind_output(present, "cpu", 0, np.float32, shape, ptr)
        self.session.run_with_iobinding(binding)
        return np.asarray(binding.get_outputs()[0].numpy())  # (n, T, V)

    def decode(self, slots: Sequence[Slot], tokens: np.ndarray) -> np.ndarray:
        lo, consecutive = self.pool.span(slots)
        if not consecutive:
            lo = self.pool.compact(slots)
        n = len(slots)
        index = np.fromiter((s.index for s in slots), np.int64, n)  # (B,) slot per row
        perm = np.argsort(index)  # bound row j is batch row perm[j]
        ordered = bool((perm == np.arange(n)).all())
        lengths = self.pool.lengths[lo:lo + n].copy()  # (n,) in slot order
        longest = int(lengths.max()) + 1
        self._check_room(longest)
        bound = np.asarray(tokens if ordered else tokens[perm], np.int64)[:, None]  # (n, 1)
        logits = self._run(lo, bound, lengths[:, None], lengths, longest)  # (n, 1, V)
        self.pool.tokens[np.arange(lo, lo + n), lengths] = bound[:, 0]
        self.pool.lengths[lo:lo + n] += 1
        if ordered:
            return logits[:, 0]
        out = np.empty((n, logits.shape[2]), logits.dtype)  # (B, V) back in batch order
        out[perm] = logits[:, 0]
        return out

    def _prefill_rows(self, slots: Sequence[Slot], prompts: Sequence[np.ndarray],
                      all_logits: bool) -> list[np.ndarray]:
        lo, consecutive = self.pool.span(slots)
        if not consecutive or [s.index for s in slots] != list(range(lo, lo + len(slots))):
            raise ValueError("engine.onnx prefills a run of consecutive empty slots in order")
        lengths = np.fromiter((len(p) for p in prompts), np.int64, len(prompts))  # (P,)
        width = int(lengths.max())
        self._check_room(width)
        ids = np.zeros((len(prompts), width), np.int64)  # (P, W) right-padded
        pos = np.zeros((len(prompts), width), np.int64)
        for j, p in enumerate(prompts):
            ids[j, :len(p)] = p
            pos[j, :len(p)] = np.arange(len(p))
        logits = self._run(lo, ids, pos, lengths - 1, width)  # (P, W, V)
        for s, p in zip(slots, prompts, strict=True):
            self._record(s.index, 0, p)
            if len(p) < width:  # the kernel wrote the padding's keys too: give those back
                self.pool.truncate(s, len(p))
        return [logits[j, :n] if all_logits else logits[j, n - 1:n]
                for j, n in enumerate(lengths.tolist())]

    def extend(self, slot: Slot, tokens: np.ndarray) -> np.ndarray:
        start = int(self.pool.lengths[slot.index])
        total = start + len(tokens)
        self._check_room(total)
        pos = np.arange(start, total, dtype=np.int64)[None, :]  # (1, T)
        logits = self._run(slot.index, np.asarray(tokens, np.int64)[None, :], pos,
                           np.array([total - 1]), total)  # (1, T, V)
        self._record(slot.index, start, tokens)
        return logits[0]
