"""Automatic prefix caching: keys and values of token blocks, found by a hash of the prefix.

As in vLLM, a prompt is cut into blocks of ``block_size`` tokens and block i is named by a
hash of (block i - 1's name, block i's tokens): equal names mean equal prefixes, so a new
request reuses the longest run of cached blocks from its start instead of computing them.
Blocks live in their own bounded store (``capacity`` blocks, allocated once); the least
recently used block is evicted first. A hit touches its chain from the last block to the
first, so a parent is always fresher than its children and is evicted after them.

Only full blocks are cached, and a lookup leaves at least one prompt token to compute
(the request needs its logits). The store copies K/V in and out of pool slots; the
pool's rows stay contiguous per slot, which GroupQueryAttention needs.

Keys and values depend on what a row runs under besides the base weights, its
``ModelVariant`` (the LoRA adapter, which every projection sees, and the control vector,
which every steered layer's output does), so each variant's chains
start at a root of their own (vLLM and SGLang key the block hash by the LoRA too): a
prefix computed under one variant never serves another, nor the base.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from service.engine.kv_pool import KVPool
from service.engine.request import BASE, ModelVariant

ROOT = 0  # the parent name of a prompt's first block, under the base model


def root_of(variant: ModelVariant) -> int:
    """The parent name of a prompt's first block computed under ``variant``."""
    return ROOT if variant == BASE else hash(("variant", variant)) or 1


@dataclass
class _Block:
    name: int
    index: int  # row in the store
    parent: int
    tokens: bytes  # the block's token ids, to rule out hash collisions


@dataclass
class PrefixCacheCounters:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens whose K/V came from the cache
    inserted: int = 0  # blocks stored
    evicted: int = 0  # blocks evicted (LRU)


class PrefixCache:
    def __init__(self, pool: KVPool, block_size: int, capacity_blocks: int) -> None:
        if block_size < 1 or capacity_blocks < 1:
            raise ValueError("prefix cache needs block_size >= 1 and capacity >= 1 block")
        self.pool = pool
        self.block_size = block_size
        self.capacity = capacity_blocks
        shape = pool.shape
        # (blocks, 2 * n_layers, nh, block, hs): one block of every layer in one row
        self.store = np.empty((capacity_blocks, shape.layers, shape.heads, block_size,
                               shape.head_dim), shape.dtype)
        self._blocks: OrderedDict[int, _Block] = OrderedDict()  # LRU order, oldest first
        self._free = list(range(capacity_blocks - 1, -1, -1))
        self.counters = PrefixCacheCounters()

    @property
    def bytes_allocated(self) -> int:
        return int(self.store.nbytes)

    @property
    def blocks_used(self) -> int:
        return len(self._blocks)

    def _names(self, tokens: np.ndarray, n_blocks: int, variant: ModelVariant
               ) -> list[tuple[int, int, bytes]]:
        """(name, parent, token bytes) for the first ``n_blocks`` blocks of ``tokens``,
        the chain starting at ``variant``'s root."""
        out = []
        parent = root_of(variant)
        bs = self.block_size
        for b in range(n_blocks):
            data = tokens[b * bs:(b + 1) * bs].astype(np.int64).tobytes()
            name = hash((parent, data)) or 1  # 0 is ROOT
            out.append((name, parent, data))
            parent = name
        return out

    def _chain(self, tokens: np.ndarray, n_blocks: int, variant: ModelVariant
               ) -> list[_Block]:
        chain = []
        for name, parent, data in self._names(tokens, n_blocks, variant):
            block = self._blocks.get(name)
            if block is None or block.parent != parent or block.tokens != data:
                break
            chain.append(block)
        return chain

    def match(self, prompt: np.ndarray, variant: ModelVariant = BASE) -> int:
        """Tokens of ``prompt`` a ``load`` would reuse now (counted as a lookup), computed
        under ``variant``.

        At most len(prompt) - 1 tokens, so the request still computes one.
        """
        self.counters.queries += len(prompt)
        return len(self._chain(prompt, (len(prompt) - 1) // self.block_size,
                               variant)) * self.block_size

    def load(self, prompt: np.ndarray, slot: int, variant: ModelVariant = BASE) -> int:
        """Copy the longest cached prefix of ``prompt`` under ``variant`` into the empty
        ``slot``; tokens reused."""
        bs = self.block_size
        chain = self._chain(prompt, (len(prompt) - 1) // bs, variant)
        if not chain:
            return 0
        for block in reversed(chain):  # parents end up fresher than children
            self._blocks.move_to_end(block.name)
        n = len(chain) * bs
        # Block by block, straight from the store into the slot: one copy of the bytes,
        # no gathered (n, layers, nh, bs, hs) intermediate (a long prefix is tens of MB,
        # and the running rows wait while it is copied).
        for b, block in enumerate(chain):
            rows = self.store[block.index]  # (layers, nh, bs, hs), a view
            for layer, array in enumerate(self.pool.arrays):
                array[slot, :, b * bs:(b + 1) * bs] = rows[layer]  # (nh, bs, hs)
        self.pool.tokens[slot, :n] = prompt[:n]
        self.pool.lengths[slot] = n
        self.counters.hits += n
        return n

    def save(self, slot: int, variant: ModelVariant = BASE) -> None:
        """Store the full blocks ``slot`` holds, computed under ``variant``, that are not
        cached yet."""
        bs = self.block_size
        length = int(self.pool.lengths[slot])
        tokens = self.pool.tokens[slot, :length]
        names = self._names(tokens, length // bs, variant)
        keep: set[int] = set()
        for b, (name, parent, data) in enumerate(names):
            keep.add(name)
            block = self._blocks.get(name)
            if block is not None and block.parent == parent and block.tokens == data:
                continue
            index = block.index if block is not None else self._take(keep)  # collision: reuse
            if index is None:
                break  # everything left is this chain's own prefix: stop here
            for layer, array in enumerate(self.pool.arrays):
                self.store[index, layer] = array[slot, :, b * bs:(b + 1) * bs]  # (nh, bs, hs)
            self._blocks[name] = _Block(name, index, parent, data)
            self.counters.inserted += 1
        for name in reversed([n for n, _, _ in names]):  # parents fresher than children
            if name in self._blocks:
                self._blocks.move_to_end(name)

    def _take(self, protected: set[int]) -> int | None:
        if self._free:
            return self._free.pop()
        name, block = next(iter(self._blocks.items()))
        if name in protected:
            return None
        del self._blocks[name]
        self.counters.evicted += 1
        return block.index

    def clear(self) -> None:
        self._free = list(range(self.capacity - 1, -1, -1))
        self._blocks.clear()
