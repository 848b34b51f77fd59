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

Each pass names the positions whose logits it needs (``logits_index``: a decode step's
one token, a prompt's last, every token only for prompt logprobs or drafted tokens), so
the LM head runs on those rows alone, and the logits land in a numpy array of exactly
that size, bound as the output: ONNX Runtime's arena never holds them. A multi-token
pass also asks the arena to give its activations back to the OS once done
(``memory.enable_memory_arena_shrinkage``), so one long prompt does not raise the
process's memory for good. An engine.onnx exported before ``logits_index`` computes every
position's logits; its wanted rows are picked out here.
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
        missing = [name for name in missing if name not in es.GATHERED_INPUTS]
        if missing:
            raise ValueError(f"{es.ENGINE_FILE} lacks {missing}")
        self._gathers = es.LOGITS_INDEX in inputs  # False: an engine.onnx of before it
        self._shrink = ort.RunOptions()  # for multi-token passes: the arena gives back
        self._shrink.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        super().__init__(config, pool, np.dtype(np.float32))
        self.session = session
        self.graph_file = es.ENGINE_FILE
        self.provider = session.get_providers()[0]
        self.device = "cpu"
        self._past, self._present = io.past_names(n), io.present_names(n)

    def _arrange(self, slots: Sequence[Slot], start: int | None) -> None:
        self.pool.compact(slots, start)

    def _run(self, lo: int, ids: np.ndarray, pos: np.ndarray, seqlens: np.ndarray,
             total: int, index: np.ndarray) -> np.ndarray:
        """One pass over slots [lo, lo + n): ids/pos (n, T) right-padded; logits (n, K, V)
        of the positions ``index`` (n, K) of each row."""
        n, t = ids.shape
        binding = self.session.io_binding()
        index = np.ascontiguousarray(index, np.int64)  # (n, K)
        # Our own array as the output: freed with the caller's last reference, never
        # cached by ONNX Runtime's arena.
        logits = np.empty((n, index.shape[1] if self._gathers else t, self.vocab_size),
                          np.float32)  # (n, K or T, V)
        binding.bind_output(io.LOGITS, "cpu", 0, np.float32, list(logits.shape),
                            logits.ctypes.data)
        if self._gathers:
            binding.bind_cpu_input(es.LOGITS_INDEX, index)
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
        self.session.run_with_iobinding(binding, self._shrink if t > 1 else None)
        if self._gathers:
            return logits  # (n, K, V)
        return logits[np.arange(n)[:, None], index]  # (n, K, V) of the old graph's (n, T, V)

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
        logits = self._run(lo, bound, lengths[:, None], lengths, longest,
                           np.zeros((n, 1), np.int64))  # (n, 1, V)
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
        if all_logits:  # every position: (P, W), the padding's rows dropped below
            index = np.tile(np.arange(width, dtype=np.int64), (len(prompts), 1))
        else:  # each row's last real token: (P, 1)
            index = (lengths - 1)[:, None]
        logits = self._run(lo, ids, pos, lengths - 1, width, index)  # (P, W or 1, V)
        for s, p in zip(slots, prompts, strict=True):
            self._record(s.index, 0, p)
            if len(p) < width:  # the kernel wrote the padding's keys too: give those back
                self.pool.truncate(s, len(p))
        return [logits[j, :n] if all_logits else logits[j]
                for j, n in enumerate(lengths.tolist())]

    def extend(self, slot: Slot, tokens: np.ndarray) -> np.ndarray:
        return self._extend(slot, tokens, np.arange(len(tokens), dtype=np.int64))  # (T, V)

    def extend_last(self, slot: Slot, tokens: np.ndarray) -> np.ndarray:
        return self._extend(slot, tokens, np.array([len(tokens) - 1], np.int64))  # (1, V)

    def _extend(self, slot: Slot, tokens: np.ndarray, index: np.ndarray) -> np.ndarray:
        """Feed ``tokens`` (T,) after the row's cache; logits (K, V) of positions ``index``."""
        start = int(self.pool.lengths[slot.index])
        total = start + len(tokens)
        self._check_room(total)
        pos = np.arange(start, total, dtype=np.int64)[None, :]  # (1, T)
        logits = self._run(slot.index, np.asarray(tokens, np.int64)[None, :], pos,
                           np.array([total - 1]), total, index[None, :])  # (1, K, V)
        self._record(slot.index, start, tokens)
        return logits[0]
