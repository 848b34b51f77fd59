"""engine.onnx behind the batch's ModelRunner: a persistent KV pool written in place.

model.onnx returns a new, one-column-longer present for every layer at every step
(Concat of past and new). engine.onnx instead takes one preallocated cache per layer,
(B, nh, max_seq_len, hs), as both past and present, and its GroupQueryAttention writes
the new keys and values into it in place. Here that cache is a run of slots of the
engine's KVPool (service/engine/kv_pool.py), bound by pointer: nothing is allocated per
request and nothing is copied per step.

The batch keeps its left-padded bookkeeping (attention_mask, position_ids); this runner
translates at the boundary. In the pool each row's tokens start at column 0 and the
pool's ``lengths`` say how many are cached, which is what the kernel reads (``seqlens_k``).
A batch's kv is a ``PoolKV``: the slot of each of its rows, in row order. Joining merges
slot lists; leaving frees slots and moves at most one row per leave (``KVPool.compact``).

Prompts: rows with empty slots are prefilled together (GroupQueryAttention's first-prompt
mode, right-padded). A row whose prompt starts with a cached prefix (prefix_cache.py)
gets those keys and values copied into its slot and computes only the rest, as a
multi-token step over a non-empty cache; ONNX Runtime runs that for one row at a time,
as it does each chunk of a chunked prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime as ort

from service.contract import engine_spec as es
from service.contract import io_spec as io
from service.engine.kv_pool import KVPool, PoolShape, Slot, ensure_memory
from service.engine.prefix_cache import PrefixCache
from service.engine.stats import KVStats, PrefixCacheStats


@dataclass
class PoolKV:
    """One batch's cache: the pool slot of each row, in the batch's row order."""

    slots: list[Slot]


@dataclass(frozen=True)
class PoolConfig:
    slots: int  # rows the pool holds (≥ the batch size the scheduler may form)
    prefix_block_size: int = 16
    prefix_cache_blocks: int = 0  # 0: no prefix caching
    max_len: int | None = None  # tokens per slot (max_total_tokens); None: the model context


class StaticCacheModel:
    """ModelRunner over engine.onnx with a persistent float32 KV pool on the host."""

    supports_chunked_prefill = True

    def __init__(self, session: ort.InferenceSession, config: io.ArtifactConfig,
                 pool: PoolConfig | None = None) -> None:
        self.session = session
        self.config = config
        self.vocab_size = config.vocab_size
        self.graph_file = es.ENGINE_FILE
        self.provider = session.get_providers()[0]
        self.device = "cpu"
        pool = pool or PoolConfig(slots=8)
        self.max_len = pool.max_len or config.max_seq_len
        if not 1 < self.max_len <= config.max_seq_len:
            raise ValueError(f"KV pool slots of {self.max_len} tokens: must be 2.."
                             f"{config.max_seq_len} (the model's context)")
        n = config.n_layers
        self._past, self._present = io.past_names(n), io.present_names(n)
        inputs = {i.name for i in session.get_inputs()}
        outputs = {o.name for o in session.get_outputs()}
        missing = sorted(({*es.engine_input_names(n)} - inputs)
                         | ({*es.engine_output_names(n)} - outputs))
        if missing:
            raise ValueError(f"{es.ENGINE_FILE} lacks {missing}")
        self.shape = PoolShape(2 * n, config.kv_heads, self.max_len, config.head_dim,
                               np.dtype(np.float32))
        ensure_memory(pool.slots * self.shape.slot_bytes
                      + pool.prefix_cache_blocks * pool.prefix_block_size * self.shape.token_bytes,
                      f"{pool.slots} slots x {self.max_len} tokens x "
                      f"{self.shape.token_bytes:,} bytes, plus the prefix cache")
        self.pool = KVPool(self.shape, pool.slots)
        self.prefix: PrefixCache | None = None
        if pool.prefix_cache_blocks > 0:
            self.prefix = PrefixCache(self.pool, pool.prefix_block_size,
                                      pool.prefix_cache_blocks)

    # -- forward ---------------------------------------------------------------------

    def reserve(self, rows: int, top: bool = False) -> PoolKV:
        """Empty slots for a batch prefilled in chunks (``top``: away from the running rows)."""
        return PoolKV(self.pool.allocate(rows, top))

    def reuse_prefix(self, kv: PoolKV, prompt: Sequence[int]) -> int:
        """Copy the cached prefix of ``prompt`` into the empty slot of a one-row ``kv`` (a
        chunked prefill, which then starts after it); tokens reused."""
        if self.prefix is None or len(kv.slots) != 1:
            return 0
        ids = np.asarray(prompt, np.int64)
        if not self.prefix.match(ids):
            return 0
        return self.prefix.load(ids, kv.slots[0].index)

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray,
                position_ids: np.ndarray, past: Any, all_logits: bool
                ) -> tuple[np.ndarray, PoolKV]:
        """Logits as the batch expects them ((B, T, V) left-padded or (B, 1, V)), and the kv."""
        b, t = input_ids.shape
        if past is not None and not isinstance(past, PoolKV):
            raise TypeError(f"{type(past).__name__} is not a pool KV cache")
        kv = past if past is not None else PoolKV(self.pool.allocate(b))
        new = attention_mask[:, -t:].sum(axis=1).astype(np.int64)  # (B,) real new tokens
        try:
            if t == 1:
                logits = self._decode(kv, input_ids, position_ids)
            else:
                logits = self._prompt(kv, input_ids, position_ids, new, all_logits)
        except BaseException:
            if past is None:
                self.pool.free(kv.slots)
            raise
        return logits, kv

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

    def _decode(self, kv: PoolKV, ids: np.ndarray, pos: np.ndarray) -> np.ndarray:
        lo, consecutive = self.pool.span(kv.slots)
        if not consecutive:
            lo = self.pool.compact(kv.slots)
        n = len(kv.slots)
        index = np.fromiter((s.index for s in kv.slots), np.int64, n)  # (B,) slot per row
        perm = np.argsort(index)  # bound row j is batch row perm[j]
        ordered = bool((perm == np.arange(n)).all())
        lengths = self.pool.lengths[lo:lo + n]  # (n,) in slot order
        if int(lengths.max()) + 1 > self.max_len:
            raise ValueError(f"sequence of {int(lengths.max()) + 1} tokens exceeds "
                             f"max_seq_len {self.max_len}")
        bound_ids = ids if ordered else ids[perm]  # (n, 1)
        bound_pos = pos if ordered else pos[perm]
        logits = self._run(lo, bound_ids, bound_pos, lengths, int(lengths.max()) + 1)
        self.pool.tokens[np.arange(lo, lo + n), lengths] = bound_ids[:, 0]
        self.pool.lengths[lo:lo + n] += 1
        if ordered:
            return logits
        out = np.empty_like(logits)  # (B, 1, V) back in batch order
        out[perm] = logits
        return out

    def _prompt(self, kv: PoolKV, ids: np.ndarray, pos: np.ndarray, new: np.ndarray,
                all_logits: bool) -> np.ndarray:
        b, t = ids.shape
        prompts = [ids[r, t - new[r]:] for r in range(b)]  # real tokens of each row
        starts = [int(self.pool.lengths[s.index]) for s in kv.slots]
        if any(starts):
            if b != 1:
                raise ValueError("a multi-token step over a non-empty cache runs one row")
            logits = self._extend(kv.slots[0].index, prompts[0], pos[0, t - new[0]:])
            self._save(kv)
            return logits if all_logits else logits[:, -1:]
        hits = [0] * b
        if self.prefix is not None and not all_logits:
            hits = [self.prefix.match(p) for p in prompts]
        plain = [r for r in range(b) if not hits[r]]
        reused = [r for r in range(b) if hits[r]]
        order = sorted(s.index for s in kv.slots)
        self.pool.assign([kv.slots[r] for r in plain + reused], order)  # plain rows first
        out = np.zeros((b, t if all_logits else 1, self.vocab_size), np.float32)
        if plain:
            lo = order[0]
            width = int(new[plain].max())
            rids = np.zeros((len(plain), width), np.int64)  # (P, W) right-padded
            rpos = np.zeros((len(plain), width), np.int64)
            for j, r in enumerate(plain):
                rids[j, :new[r]] = prompts[r]
                rpos[j, :new[r]] = pos[r, t - new[r]:]
            logits = self._run(lo, rids, rpos, new[plain] - 1, width)  # (P, W, V)
            for j, r in enumerate(plain):
                slot = kv.slots[r].index
                self.pool.tokens[slot, :new[r]] = prompts[r]
                self.pool.lengths[slot] = new[r]
                if all_logits:
                    out[r, t - new[r]:] = logits[j, :new[r]]
                else:
                    out[r, 0] = logits[j, new[r] - 1]
        for r in reused:
            slot = kv.slots[r].index
            assert self.prefix is not None
            m = self.prefix.load(prompts[r], slot)
            logits = self._extend(slot, prompts[r][m:], pos[r, t - new[r] + m:])
            out[r, 0] = logits[0, -1]
        self._save(kv)
        return out

    def _save(self, kv: PoolKV) -> None:
        if self.prefix is not None:
            for s in kv.slots:
                self.prefix.save(s.index)

    def _extend(self, slot: int, tokens: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Feed ``tokens`` to one row after what its slot holds; logits (1, T, V)."""
        start = int(self.pool.lengths[slot])
        total = start + len(tokens)
        if total > self.max_len:
            raise ValueError(f"sequence of {total} tokens exceeds max_seq_len {self.max_len}")
        logits = self._run(slot, tokens[None, :], pos[None, :], np.array([total - 1]), total)
        self.pool.tokens[slot, start:total] = tokens
        self.pool.lengths[slot] = total
        return logits

    # -- composition -----------------------------------------------------------------

    def kv_filter(self, kv: PoolKV, rows: Sequence[int], trim: int) -> PoolKV | None:
        """Keep ``rows``; free the others' slots and close the holes (≤ one move per leave)."""
        keep = {int(r) for r in rows}
        start = min(s.index for s in kv.slots)  # the batch's run begins here, and stays
        dropped = [s for i, s in enumerate(kv.slots) if i not in keep]
        if self.prefix is not None:
            for s in dropped:  # what the request generated may start the next turn's prompt
                self.prefix.save(s.index)
        self.pool.free(dropped)
        kept = [kv.slots[int(r)] for r in rows]
        if not kept:
            return None
        self.pool.compact(kept, start)
        return PoolKV(kept)

    def kv_concat(self, kvs: Sequence[Any], widths: Sequence[int], width: int) -> PoolKV:
        slots = [s for kv in kvs for s in kv.slots]
        self.pool.compact(slots)
        return PoolKV(slots)

    def kv_stats(self, kv: Any) -> KVStats:
        pool = self.pool
        return KVStats(slots=pool.slots, slots_used=pool.used, tokens=pool.tokens_held,
                       capacity_tokens=pool.capacity_tokens,
                       bytes_allocated=pool.bytes_allocated, rows_moved=pool.moves)

    def prefix_stats(self) -> PrefixCacheStats | None:
        if self.prefix is None:
            return None
        c = self.prefix.counters
        return PrefixCacheStats(queries=c.queries, hits=c.hits, blocks=self.prefix.blocks_used,
                                capacity_blocks=self.prefix.capacity,
                                block_size=self.prefix.block_size,
                                bytes_allocated=self.prefix.bytes_allocated,
                                evictions=c.evicted)
