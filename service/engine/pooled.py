"""What both runners share: the KV pool, the prefix cache, and the rows' bookkeeping.

A runner owns one ``KVPool`` (kv_pool.py): a row is a ``Slot`` and the pool's ``lengths``
say how many of its tokens are cached, so a row's next position is its length and
rolling a row back (``truncate``) is setting it lower. The pool's memory is checked
against the token budget (``PoolConfig.budget_tokens``), not slots x max_len: the
scheduler's admission never lets more tokens in than the budget.

``run`` executes a step's plan (step_plan.py) with the passes below, which subclasses
supply for their graph: ``_prefill_rows`` (empty slots, whole prompts, batched),
``decode`` (one token per row) and ``extend`` (several tokens after one row's cache;
``extend_last`` when only the last token's logits are needed), and, where the graph takes
a second group of rows, ``decode_with_chunk`` and ``decode_with_prompts`` (one pass).
``_arrange`` lays a batch's slots out as the graph needs them (engine.onnx binds one run
of consecutive slots; model.onnx gathers, so anything goes).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from service.contract import io_spec as io
from service.engine.device import SampledRows
from service.engine.kv_pool import KVPool, PoolShape, Slot, ensure_memory
from service.engine.prefix_cache import PrefixCache
from service.engine.runner import PoolConfig
from service.engine.stats import KVStats, PrefixCacheStats
from service.engine.step_plan import DecodeWork, PassKind, StepPlan, StepResult


class PooledRunner:
    """The pool-owning half of a ModelRunner; see runner.py for the contract."""

    vocab_size: int
    graph_file: str
    provider: str
    device: str
    mixes_chunks: bool = False  # decode_with_chunk is one pass over the weights
    samples_on_device: bool = False  # decode_ids draws sampled tokens beside the logits

    @property
    def float32_pass_tokens(self) -> int | None:
        """No float32 weights for long passes here (EngineGraphRunner may have them)."""
        return None

    def __init__(self, config: io.ArtifactConfig, pool: PoolConfig, dtype: np.dtype,
                 device: str = "cpu") -> None:
        """``device`` "cuda": the pool in GPU memory (device.py), no prefix cache."""
        self.config = config
        self.vocab_size = config.vocab_size
        self.max_len = pool.max_len or config.max_seq_len
        if not 1 < self.max_len <= config.max_seq_len:
            raise ValueError(f"KV pool slots of {self.max_len} tokens: must be 2.."
                             f"{config.max_seq_len} (the model's context)")
        self.shape = PoolShape(2 * config.n_layers, config.kv_heads, self.max_len,
                               config.head_dim, dtype)
        virtual = pool.slots * self.max_len
        self._budget = min(pool.budget_tokens, virtual) if pool.budget_tokens else virtual
        token_bytes = self.shape.token_bytes
        self.prefix: PrefixCache | None = None
        if device != "cpu":  # allocated whole, where ONNX Runtime's allocator says if it fits
            from service.engine.device import DeviceKVPool

            self.pool: KVPool = DeviceKVPool(self.shape, pool.slots)
            return
        ensure_memory(self._budget * token_bytes
                      + pool.prefix_cache_blocks * pool.prefix_block_size * token_bytes,
                      f"a budget of {self._budget:,} tokens x {token_bytes:,} bytes "
                      f"({pool.slots} slots of up to {self.max_len} tokens), plus the "
                      "prefix cache")
        self.pool = KVPool(self.shape, pool.slots)
        if pool.prefix_cache_blocks > 0:
            self.prefix = PrefixCache(self.pool, pool.prefix_block_size,
                                      pool.prefix_cache_blocks)

    @property
    def capacity(self) -> int:
        return self.pool.slots

    @property
    def budget_tokens(self) -> int:
        return self._budget

    @property
    def rows_used(self) -> int:
        return self.pool.used

    def cached_length(self, slot: Slot) -> int:
        return int(self.pool.lengths[slot.index])

    def kv_resident_bytes(self) -> int:
        return self.pool.resident_bytes

    # -- rows ------------------------------------------------------------------------

    def reserve(self, rows: int, top: bool = False) -> list[Slot]:
        return self.pool.allocate(rows, top)

    def reuse_prefix(self, slot: Slot, prompt: Sequence[int]) -> int:
        if self.prefix is None:
            return 0
        ids = np.asarray(prompt, np.int64)
        if not self.prefix.match(ids):
            return 0
        return self.prefix.load(ids, slot.index)

    def truncate(self, slot: Slot, length: int) -> None:
        self.pool.truncate(slot, length)  # pages past ``length`` go back to the OS

    def leave(self, slots: Sequence[Slot], keep: Sequence[int]) -> list[Slot]:
        if not slots:
            return []
        kept_rows = {int(r) for r in keep}
        start = min(s.index for s in slots)  # the batch's run begins here, and stays
        dropped = [s for i, s in enumerate(slots) if i not in kept_rows]
        if self.prefix is not None:
            for s in dropped:  # what the request generated may start the next turn's prompt
                self.prefix.save(s.index)
        self.pool.free(dropped)
        kept = [slots[int(r)] for r in keep]
        if kept:
            self._arrange(kept, start)
        return kept

    def join(self, groups: Sequence[Sequence[Slot]]) -> list[Slot]:
        slots = [s for group in groups for s in group]
        self._arrange(slots, None)
        return slots

    def _arrange(self, slots: Sequence[Slot], start: int | None) -> None:
        """Lay a batch's slots out for the graph (default: wherever they are)."""

    def settle(self) -> None:
        """Bring the pool's arrays up to date with every pass so far. A runner that keeps
        a steady batch's newest columns elsewhere (model.onnx under CUDA) writes them back
        here and before any call that reads or moves rows; the default has none."""

    # -- a step --------------------------------------------------------------------

    def run(self, plan: StepPlan) -> StepResult:
        """Execute a step's plan (runner.py). Where the graph takes a second group of rows
        (``mixes_chunks``), the chunk, or else the newcomers' prompts, ride in the decode
        step's pass; every other part is a pass of its own: prompts, the chunk, the
        decode step, then each verified row."""
        out = StepResult()
        decode, prompts, chunk = plan.decode, plan.prompts, plan.chunk
        rides = chunk is not None or (prompts is not None and not prompts.all_logits)
        if decode is not None and self.mixes_chunks and rides:
            with _timed(out.seconds, "mixed"):
                if chunk is not None:
                    logits, out.chunk = self.decode_with_chunk(decode.slots, decode.tokens,
                                                               chunk.slot, chunk.tokens)
                    chunk = None
                else:
                    assert prompts is not None
                    logits, out.prompts = self.decode_with_prompts(
                        decode.slots, decode.tokens, prompts.slots, prompts.prompts)
                    prompts = None
                self._pick(out, decode, logits)
            decode = None
        if prompts is not None:
            with _timed(out.seconds, "prompts"):
                out.prompts = self.prefill(prompts.slots, prompts.prompts, prompts.all_logits)
        if chunk is not None:
            with _timed(out.seconds, "chunk"):
                out.chunk = self.extend_last(chunk.slot, chunk.tokens)  # (1, V)
                self._save_prefix([chunk.slot])
        if decode is not None:
            with _timed(out.seconds, "decode"):
                if decode.pick == "logits":
                    out.decode_logits = self.decode(decode.slots, decode.tokens)  # (B, V)
                else:
                    out.decode_ids = self.decode_ids(decode.slots, decode.tokens,
                                                     decode.sampled)  # (B,)
        for work in plan.verify:
            started = time.perf_counter()
            out.verify.append(self.extend(work.slot, work.tokens))  # (k + 1, V)
            out.verify_seconds.append(time.perf_counter() - started)
        return out

    def _pick(self, out: StepResult, work: DecodeWork, logits: np.ndarray) -> None:
        """A mixed pass's decode logits (B, V) as the plan asked for them."""
        if work.pick == "logits":
            out.decode_logits = logits
        elif work.pick == "argmax":
            out.decode_ids = logits.argmax(-1)
        else:
            assert work.sampled is not None
            out.decode_ids = self._draw(logits, work.sampled)

    def _draw(self, logits: np.ndarray, sampled: SampledRows) -> np.ndarray:
        """Each row's draw (B,) from its logits (B, V): runners that sample beside the
        logits (``samples_on_device``) only."""
        raise ValueError(f"{type(self).__name__} samples on the host")

    def decode_with_chunk(self, slots: Sequence[Slot], tokens: np.ndarray, slot: Slot,
                          chunk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A decode step and a prompt chunk in one pass: (B, V) and (1, V) (graphs that
        take a second group of rows only: ``mixes_chunks``)."""
        raise ValueError(f"{type(self).__name__} runs one group of rows a pass")

    def decode_with_prompts(self, slots: Sequence[Slot], tokens: np.ndarray,
                            new_slots: Sequence[Slot], prompts: Sequence[np.ndarray]
                            ) -> tuple[np.ndarray, list[np.ndarray]]:
        """A decode step and newcomers' whole prompts in one pass: (B, V) and each
        newcomer's (1, V) (``mixes_chunks`` graphs only)."""
        raise ValueError(f"{type(self).__name__} runs one group of rows a pass")

    # -- prompts ---------------------------------------------------------------------

    def prefill(self, slots: Sequence[Slot], prompts: Sequence[np.ndarray],
                all_logits: bool = False) -> list[np.ndarray]:
        """Rows with an empty slot and no cached prefix are prefilled together; a row
        whose prompt starts with a cached prefix, or whose slot already holds part of its
        prompt (chunked prefill), computes only the rest, alone (``extend``)."""
        plain, out = self._split_prompts(slots, prompts, all_logits)
        if plain:
            logits = self._prefill_rows([slots[r] for r in plain], [prompts[r] for r in plain],
                                        all_logits)
            for r, rows in zip(plain, logits, strict=True):
                out[r] = rows
        self._save_prefix(slots)
        return out

    def _split_prompts(self, slots: Sequence[Slot], prompts: Sequence[np.ndarray],
                       all_logits: bool) -> tuple[list[int], list[np.ndarray]]:
        """Give the plain rows (empty slot, no cached prefix) consecutive slots in order
        and feed every other row the rest of its prompt, alone; (the plain rows, each
        row's logits so far: (1, V) for the others, empty for the plain ones)."""
        n = len(slots)
        if len(prompts) != n:
            raise ValueError(f"{len(prompts)} prompts for {n} slots")
        starts = [int(self.pool.lengths[s.index]) for s in slots]
        if all_logits and any(starts):
            raise ValueError("prompt logits need the whole prompt in one pass")
        hits = [0] * n
        if self.prefix is not None and not all_logits:
            hits = [0 if starts[r] else self.prefix.match(prompts[r]) for r in range(n)]
        plain = [r for r in range(n) if not starts[r] and not hits[r]]
        rest = [r for r in range(n) if starts[r] or hits[r]]
        # Empty slots, plain rows first in slot order: engine.onnx binds those as one run.
        empty = [r for r in plain + rest if not starts[r]]
        self.pool.assign([slots[r] for r in empty], sorted(slots[r].index for r in empty))
        out: list[np.ndarray] = [np.empty(0)] * n
        for r in rest:
            done = starts[r]
            if hits[r]:
                assert self.prefix is not None
                done = self.prefix.load(prompts[r], slots[r].index)
            out[r] = self.extend_last(slots[r], prompts[r][done:])  # (1, V)
        return plain, out

    def _save_prefix(self, slots: Sequence[Slot]) -> None:
        """The rows' full blocks not cached yet go to the prefix cache: after a prefill,
        and after each chunk of a chunked prompt (a chunk's worth at a time, not a long
        prompt's whole copy in the step that ends it)."""
        if self.prefix is not None:
            for s in slots:
                self.prefix.save(s.index)

    def _prefill_rows(self, slots: Sequence[Slot], prompts: Sequence[np.ndarray],
                      all_logits: bool) -> list[np.ndarray]:
        raise NotImplementedError

    def decode(self, slots: Sequence[Slot], tokens: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def extend(self, slot: Slot, tokens: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def decode_ids(self, slots: Sequence[Slot], tokens: np.ndarray,
                   sampled: SampledRows | None = None) -> np.ndarray:
        """``decode``'s argmax per row, (B,) int64 (draws: ``samples_on_device`` runners
        only): a runner whose graph picks the tokens itself (a float16 engine graph on the
        GPU) copies only those."""
        if sampled is not None:
            raise ValueError(f"{type(self).__name__} samples on the host")
        return self.decode(slots, tokens).argmax(-1)

    def extend_last(self, slot: Slot, tokens: np.ndarray) -> np.ndarray:
        """``extend`` when only the last token's logits (1, V) are wanted (a prompt chunk,
        the rest of a prompt, a draft catching up): a graph that can compute just those
        overrides this."""
        return self.extend(slot, tokens)[-1:]

    def _check_room(self, total: int) -> None:
        if total > self.max_len:
            raise ValueError(f"sequence of {total} tokens exceeds max_seq_len {self.max_len}")

    def _record(self, slot: int, start: int, tokens: np.ndarray) -> None:
        """The ids of tokens just cached at [start, start + T) of ``slot``."""
        end = start + len(tokens)
        self.pool.tokens[slot, start:end] = tokens
        self.pool.lengths[slot] = end

    # -- stats -----------------------------------------------------------------------

    def kv_stats(self) -> KVStats:
        pool = self.pool
        return KVStats(slots=pool.slots, slots_used=pool.used, tokens=pool.tokens_held,
                       capacity_tokens=self._budget, bytes_allocated=pool.bytes_allocated,
                       rows_moved=pool.moves)

    def prefix_stats(self) -> PrefixCacheStats | None:
        if self.prefix is None:
            return None
        c = self.prefix.counters
        return PrefixCacheStats(queries=c.queries, hits=c.hits, blocks=self.prefix.blocks_used,
                                capacity_blocks=self.prefix.capacity,
                                block_size=self.prefix.block_size,
                                bytes_allocated=self.prefix.bytes_allocated,
                                evictions=c.evicted)


@contextmanager
def _timed(seconds: dict[PassKind, float], kind: PassKind) -> Iterator[None]:
    """Record what the block took as the pass ``kind``."""
    started = time.perf_counter()
    yield
    seconds[kind] = time.perf_counter() - started
