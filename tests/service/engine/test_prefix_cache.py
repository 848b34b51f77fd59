"""The prefix cache on its own: which blocks a prompt reuses, what a load copies, LRU.

The pool's slots are filled with random keys/values; the expectation is computed from
the tokens alone (the longest run of full blocks, from the start, equal to a block saved
before, leaving at least one prompt token) and from the source slot's arrays.
"""

from __future__ import annotations

import numpy as np
import pytest

from service.engine.kv_pool import KVPool, PoolShape, Slot
from service.engine.prefix_cache import PrefixCache
from service.engine.request import ModelVariant

SHAPE = PoolShape(layers=4, heads=2, max_len=32, head_dim=3, dtype=np.dtype(np.float32))
BS = 4  # tokens per block


def filled(pool: KVPool, tokens: list[int], seed: int) -> Slot:
    """A slot holding ``tokens`` with random keys/values, as a prefill leaves it."""
    (slot,) = pool.allocate(1)
    rng = np.random.default_rng(seed)
    for array in pool.arrays:
        array[slot.index, :, :len(tokens)] = rng.standard_normal(
            (SHAPE.heads, len(tokens), SHAPE.head_dim))  # (nh, n, hs)
    pool.tokens[slot.index, :len(tokens)] = tokens
    pool.lengths[slot.index] = len(tokens)
    return slot


def expected_reuse(saved: list[list[int]], prompt: list[int]) -> int:
    """Tokens reusable by the rule: whole blocks from the start that some saved sequence
    has at the same place, at most len(prompt) - 1 tokens."""
    n = 0
    while (n + BS <= len(prompt) - 1
           and any(s[:n + BS] == prompt[:n + BS] for s in saved if len(s) >= n + BS)):
        n += BS
    return n


def test_match_and_load_reuse_the_longest_cached_run_of_full_blocks() -> None:
    pool = KVPool(SHAPE, 4)
    cache = PrefixCache(pool, BS, capacity_blocks=16)
    first = list(range(100, 114))  # 14 tokens: three full blocks
    source = filled(pool, first, seed=1)
    cache.save(source.index)
    assert cache.blocks_used == 3
    for prompt in ([*first[:9], 7, 7, 7], [*first[:4], 1, 2, 3, 4, 5], first[:8], first[:9],
                   [5, *first], first):
        want = expected_reuse([first], prompt)
        assert cache.match(np.asarray(prompt)) == want, prompt
        (slot,) = pool.allocate(1)
        assert cache.load(np.asarray(prompt), slot.index) == want
        assert pool.lengths[slot.index] == want
        assert pool.tokens[slot.index, :want].tolist() == prompt[:want]
        for array in pool.arrays:  # the very keys/values of the source slot
            np.testing.assert_array_equal(array[slot.index, :, :want],
                                          array[source.index, :, :want])
        pool.free([slot])
    assert cache.counters.hits == sum(expected_reuse([first], p) for p in (
        [*first[:9], 7, 7, 7], [*first[:4], 1, 2, 3, 4, 5], first[:8], first[:9],
        [5, *first], first))


def test_the_store_is_bounded_and_evicts_the_least_recently_used_chain_first() -> None:
    pool = KVPool(SHAPE, 4)
    cache = PrefixCache(pool, BS, capacity_blocks=4)
    store = cache.store.ctypes.data
    a = list(range(10, 19))  # 2 full blocks
    b = list(range(50, 59))  # 2 full blocks
    c = list(range(80, 89))
    for i, tokens in enumerate((a, b)):
        slot = filled(pool, tokens, seed=i)
        cache.save(slot.index)
        pool.free([slot])
    assert cache.blocks_used == 4 and cache.counters.evicted == 0
    cache.match(np.asarray(a))  # a lookup alone does not refresh
    (slot,) = pool.allocate(1)
    assert cache.load(np.asarray(a), slot.index) == 8  # a is now fresher than b
    pool.free([slot])
    slot = filled(pool, c, seed=3)
    cache.save(slot.index)  # needs two blocks: b's go (least recently used)
    assert cache.blocks_used == 4 and cache.counters.evicted == 2
    assert cache.match(np.asarray(b)) == 0
    assert cache.match(np.asarray(a)) == 8 and cache.match(np.asarray(c)) == 8
    assert cache.store.ctypes.data == store  # allocated once, never grown


def test_a_block_is_named_by_its_whole_prefix_not_its_own_tokens() -> None:
    """The same four tokens after a different start are a different block."""
    pool = KVPool(SHAPE, 4)
    cache = PrefixCache(pool, BS, capacity_blocks=8)
    slot = filled(pool, [1, 2, 3, 4, 9, 9, 9, 9, 0], seed=0)
    cache.save(slot.index)
    assert cache.match(np.asarray([5, 6, 7, 8, 9, 9, 9, 9, 0])) == 0
    assert cache.match(np.asarray([1, 2, 3, 4, 9, 9, 9, 9, 0])) == 8
    cache.clear()
    assert cache.blocks_used == 0 and cache.match(np.asarray([1, 2, 3, 4, 9, 9, 9, 9, 0])) == 0


def test_bad_sizes_are_refused() -> None:
    pool = KVPool(SHAPE, 1)
    with pytest.raises(ValueError, match="block_size"):
        PrefixCache(pool, 0, 4)
    with pytest.raises(ValueError, match="capacity"):
        PrefixCache(pool, 4, 0)


def test_a_prefix_computed_under_one_adapter_serves_only_that_adapter() -> None:
    """Keys and values depend on the row's variant (its adapter): the same tokens saved
    under adapter 1 are a miss for the base and for adapter 2, a hit for adapter 1, and
    each keeps its own."""
    pool = KVPool(SHAPE, 4)
    cache = PrefixCache(pool, BS, capacity_blocks=16)
    tokens = list(range(200, 213))  # three full blocks and one token
    under_one = filled(pool, tokens, seed=3)
    cache.save(under_one.index, ModelVariant(adapter=1))
    prompt = np.asarray(tokens)
    assert cache.match(prompt) == 0
    assert cache.match(prompt, ModelVariant(adapter=2)) == 0
    assert cache.match(prompt, ModelVariant(adapter=1)) == 12
    base = filled(pool, tokens, seed=4)  # other keys/values for the same tokens
    cache.save(base.index)
    (slot,) = pool.allocate(1)
    assert cache.load(prompt, slot.index, ModelVariant(adapter=1)) == 12
    for array in pool.arrays:  # adapter 1's keys/values, not the base's
        np.testing.assert_array_equal(array[slot.index, :, :12], array[under_one.index, :, :12])
    pool.free([slot])
    (slot,) = pool.allocate(1)
    assert cache.load(prompt, slot.index) == 12
    for array in pool.arrays:
        np.testing.assert_array_equal(array[slot.index, :, :12], array[base.index, :, :12])
