"""The one interface between the scheduler and a decoder graph: ``ModelRunner``.

Everything the batch and the scheduler ask of a model is stated here, typed, so nothing
probes a runner for optional features. A row of a batch is a ``Slot`` of the runner's
``KVPool`` (service/engine/kv_pool.py), which is the only owner of keys and values: the
runner reads a row's cached length from the pool, feeds the new tokens after it and
writes their keys and values back, so the batch holds no cache and no padding. Each
runner lays out its own inputs (engine.onnx right-pads, model.onnx left-pads).

Two runners implement it: ``EngineGraphRunner`` (engine.onnx, pool slots bound in place;
engine_graph_runner.py) and ``ModelGraphRunner`` (model.onnx, the portable graph, past gathered
from the pool every step; model_graph_runner.py), both over ``PooledRunner`` (pooled.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from service.engine.device import SampledRows
from service.engine.kv_pool import Slot
from service.engine.stats import KVStats, PrefixCacheStats


@dataclass(frozen=True)
class PoolConfig:
    """Size of a runner's KV pool and prefix cache."""

    slots: int  # rows the pool holds: the largest batch the scheduler may form
    prefix_block_size: int = 16
    prefix_cache_blocks: int = 0  # 0: no prefix caching
    max_len: int | None = None  # tokens per slot (max_total_tokens); None: the model context
    budget_tokens: int | None = None  # tokens the pool may hold at once; None: slots x max_len


class ModelRunner(Protocol):
    """A decoder over a KV pool: what the batch and the scheduler call, and nothing else."""

    vocab_size: int
    graph_file: str  # model.onnx or engine.onnx
    provider: str  # ONNX Runtime's active execution provider
    device: str  # "cpu" or "cuda": where the session runs
    mixes_chunks: bool  # decode_with_chunk runs as one pass over the weights
    samples_on_device: bool  # decode_ids draws sampled tokens where the logits are

    @property
    def float32_twin_tokens(self) -> int | None:
        """Passes of this many tokens or more run on engine_float32.onnx; None: no twin."""
        ...

    @property
    def codes8_rows(self) -> int | None:
        """Passes of this many rows or more (below the float32 twin's tokens) run on
        engine_codes8.onnx; None: no such graph, or it is off."""
        ...

    @property
    def capacity(self) -> int:
        """Rows the runner can hold at once (the pool's slots)."""
        ...

    @property
    def budget_tokens(self) -> int:
        """Tokens the pool may hold at once, over all rows (the KV memory budget)."""
        ...

    @property
    def max_len(self) -> int:
        """Tokens one row can hold."""
        ...

    @property
    def rows_used(self) -> int:
        """Rows holding a sequence now."""
        ...

    def cached_length(self, slot: Slot) -> int:
        """Tokens of row ``slot`` in the cache."""
        ...

    def kv_resident_bytes(self) -> int:
        """Bytes of the KV cache in RAM now (the pool's touched pages)."""
        ...

    def reserve(self, rows: int, top: bool = False) -> list[Slot]:
        """Empty slots for new rows (``top``: away from the running rows)."""
        ...

    def prefill(self, slots: Sequence[Slot], prompts: Sequence[np.ndarray],
                all_logits: bool = False) -> list[np.ndarray]:
        """Feed each empty slot its whole prompt (reusing cached prefixes unless
        ``all_logits``); per row the logits (T_i, V) of every prompt token, or (1, V) of
        the last one."""
        ...

    def decode(self, slots: Sequence[Slot], tokens: np.ndarray) -> np.ndarray:
        """One token per row (tokens (B,)) after each row's cache; logits (B, V)."""
        ...

    def decode_ids(self, slots: Sequence[Slot], tokens: np.ndarray,
                   sampled: SampledRows | None = None) -> np.ndarray:
        """``decode`` with the next tokens chosen where the logits are: (B,) int64, which
        is all a graph that picks them on the GPU copies back. Without ``sampled`` every
        row takes the argmax; with it (``samples_on_device`` runners only) each row's
        plain temperature/top-k/top-p draw from its own number."""
        ...

    def decode_with_chunk(self, slots: Sequence[Slot], tokens: np.ndarray, slot: Slot,
                          chunk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``decode(slots, tokens)`` and ``extend_last(slot, chunk)`` (a prompt chunk of a
        row that is not decoding): logits (B, V) and (1, V). engine_mixed.onnx computes
        both in one pass, so the chunk costs its tokens' arithmetic, not another read of
        the weights (``mixes_chunks``). The prompt's full blocks go to the prefix cache
        chunk by chunk, as after ``prefill``."""
        ...

    def decode_with_prompts(self, slots: Sequence[Slot], tokens: np.ndarray,
                            new_slots: Sequence[Slot], prompts: Sequence[np.ndarray]
                            ) -> tuple[np.ndarray, list[np.ndarray]]:
        """``decode(slots, tokens)`` and ``prefill(new_slots, prompts)`` (newcomers joining
        the batch): logits (B, V) and each newcomer's last (1, V). engine_mixed.onnx
        feeds the prompts without a cached prefix in the decode step's pass."""
        ...

    def extend(self, slot: Slot, tokens: np.ndarray) -> np.ndarray:
        """Feed ``tokens`` (T,) to one row after what its slot holds (a prompt chunk, the
        rest of a prompt after a reused prefix, drafted tokens to verify); logits (T, V)
        for every fed token."""
        ...

    def extend_last(self, slot: Slot, tokens: np.ndarray) -> np.ndarray:
        """``extend`` when only the last fed token's logits (1, V) are needed: a graph that
        gathers positions before the LM head computes just that one."""
        ...

    def truncate(self, slot: Slot, length: int) -> None:
        """Keep only the first ``length`` cached tokens of a row (drop rejected drafts)."""
        ...

    def reuse_prefix(self, slot: Slot, prompt: Sequence[int]) -> int:
        """Load the cached prefix of ``prompt`` into the empty ``slot``; tokens reused."""
        ...

    def leave(self, slots: Sequence[Slot], keep: Sequence[int]) -> list[Slot]:
        """Rows not in ``keep`` leave: their blocks go to the prefix cache and their slots
        are freed. The kept slots, in ``keep`` order, laid out as the runner needs."""
        ...

    def join(self, groups: Sequence[Sequence[Slot]]) -> list[Slot]:
        """One batch's slots from several batches' (in order), laid out as the runner needs."""
        ...

    def kv_stats(self) -> KVStats: ...

    def prefix_stats(self) -> PrefixCacheStats | None: ...
