"""The KV pool's bookkeeping against a numpy model of what each row must hold.

Every live row keeps its own copy of the keys/values and token ids it was given (the
model); after any sequence of allocate, free, move, compact and truncate, the pool must
hold exactly those at each row's current slot, no two rows may share a slot, and a batch
compacted into a run must sit in consecutive slots with the rows already inside the run
left where they were.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from service.engine.kv_pool import KVPool, PoolExhausted, PoolShape, Slot, ensure_memory

SHAPE = PoolShape(layers=4, heads=2, max_len=8, head_dim=3, dtype=np.dtype(np.float32))


class Model:
    """The expected content of every live row, by Slot object."""

    def __init__(self, pool: KVPool, seed: int = 0) -> None:
        self.pool = pool
        self.rows: dict[int, tuple[Slot, np.ndarray, np.ndarray]] = {}  # id(slot) -> ...
        self.rng = np.random.default_rng(seed)

    def fill(self, slot: Slot, n: int) -> None:
        """Write n tokens of random keys/values into ``slot`` (as a prefill would)."""
        kv = self.rng.standard_normal((SHAPE.layers, SHAPE.heads, n, SHAPE.head_dim)).astype(
            np.float32)  # (layers, nh, n, hs)
        ids = self.rng.integers(0, 1000, n)
        for layer, array in enumerate(self.pool.arrays):
            array[slot.index, :, :n] = kv[layer]
        self.pool.tokens[slot.index, :n] = ids
        self.pool.lengths[slot.index] = n
        self.rows[id(slot)] = (slot, kv, ids)

    def drop(self, slots: list[Slot]) -> None:
        for s in slots:
            self.rows.pop(id(s), None)

    def check(self) -> None:
        pool = self.pool
        indices = [s.index for s, _, _ in self.rows.values()]
        assert len(set(indices)) == len(indices), "two rows share a slot"
        assert pool.used == len(self.rows)
        assert pool.tokens_held == sum(len(ids) for _, _, ids in self.rows.values())
        for slot, kv, ids in self.rows.values():
            n = len(ids)
            assert pool.lengths[slot.index] == n
            np.testing.assert_array_equal(pool.tokens[slot.index, :n], ids)
            for layer, array in enumerate(pool.arrays):
                np.testing.assert_array_equal(array[slot.index, :, :n], kv[layer])
        free = set(range(pool.slots)) - set(indices)
        assert all(pool.lengths[i] == 0 for i in free)


def test_allocate_takes_the_lowest_or_highest_free_run_and_refuses_when_none_is_left() -> None:
    pool = KVPool(SHAPE, 6)
    low = pool.allocate(2)
    top = pool.allocate(1, top=True)
    assert [s.index for s in low] == [0, 1] and [s.index for s in top] == [5]
    assert pool.span(low) == (0, True)
    middle = pool.allocate(3)
    assert [s.index for s in middle] == [2, 3, 4] and pool.used == 6
    with pytest.raises(PoolExhausted):
        pool.allocate(1)
    pool.free([middle[1]])  # a hole at 3: one slot fits, two do not
    with pytest.raises(PoolExhausted):
        pool.allocate(2)
    assert [s.index for s in pool.allocate(1)] == [3]
    assert pool.span([low[0], middle[2]]) == (0, False)


def test_free_slots_apart_make_a_run_by_moving_the_fewest_rows() -> None:
    """As a server's pool was when two newcomers' step failed (the run was refused and the
    scheduler retried them one by one): a batch at the bottom, a long prompt part-way
    through its chunks at the top, a row gone from the batch, so two slots are free but
    apart. The newcomers get a run; one row moves out of it; every row keeps its cache."""
    pool = KVPool(SHAPE, 8)
    model = Model(pool)
    batch = pool.allocate(6)
    (partial,) = pool.allocate(1, top=True)
    assert [s.index for s in batch] == list(range(6)) and partial.index == 7
    for i, s in enumerate([*batch, partial]):
        model.fill(s, 1 + i)
    pool.free([batch[3]])
    model.drop([batch[3]])
    moves = pool.moves
    fresh = pool.allocate(2)  # free: 3 and 6
    assert pool.span(fresh)[1] and pool.moves - moves == 1
    assert all(pool.lengths[s.index] == 0 for s in fresh)
    for s in fresh:
        model.fill(s, 2)
    model.check()
    with pytest.raises(PoolExhausted, match="no 1 free slots"):
        pool.allocate(1)


def test_move_and_compact_keep_every_rows_cache_and_make_a_batch_consecutive() -> None:
    pool = KVPool(SHAPE, 8)
    model = Model(pool)
    batch = pool.allocate(5)
    other = pool.allocate(1)  # another batch's row right above
    for i, s in enumerate([*batch, *other]):
        model.fill(s, 2 + i)
    model.check()
    # Rows 1 and 3 leave: compacting from the old start moves at most one row per hole.
    leaving = [batch[1], batch[3]]
    pool.free(leaving)
    model.drop(leaving)
    kept = [batch[0], batch[2], batch[4]]
    inside = {id(s): s.index for s in kept if s.index < 3}
    moves = pool.moves
    assert pool.compact(kept, 0) == 0
    assert sorted(s.index for s in kept) == [0, 1, 2]
    assert pool.moves - moves == 1  # only the row at 4 moved (into the hole at 1 or 3)
    assert all(s.index == inside[id(s)] for s in kept if id(s) in inside)
    model.check()
    # A row of another batch in the way is moved out first; contents follow every move.
    outsider = pool.allocate(1, top=True)[0]
    model.fill(outsider, 3)
    pool.move(outsider, 3)
    joined = [*kept, outsider]
    pool.compact(joined)
    lo, consecutive = pool.span(joined)
    assert consecutive and lo == 0
    model.check()
    with pytest.raises(ValueError, match="taken"):
        pool.move(outsider, kept[0].index)


def test_random_operations_against_the_model() -> None:
    """A seeded random walk of allocate / free / compact / move / truncate."""
    rnd = random.Random(7)
    pool = KVPool(SHAPE, 10)
    model = Model(pool, seed=7)
    batches: list[list[Slot]] = []
    for _ in range(300):
        op = rnd.choice(["allocate", "free", "compact", "truncate", "move"])
        if op == "allocate":
            n = rnd.randint(1, 3)
            try:
                slots = pool.allocate(n, top=rnd.random() < 0.3)
            except PoolExhausted:
                continue
            for s in slots:
                model.fill(s, rnd.randint(1, SHAPE.max_len))
            batches.append(slots)
        elif op == "free" and batches:
            batch = rnd.choice(batches)
            leaving = rnd.sample(batch, rnd.randint(1, len(batch)))
            pool.free(leaving)
            model.drop(leaving)
            batch[:] = [s for s in batch if s not in leaving]
            batches = [b for b in batches if b]
        elif op == "compact" and batches:
            batch = rnd.choice(batches)
            before = {id(s): s.index for s in batch}
            try:
                lo = pool.compact(batch)
            except PoolExhausted:
                continue
            assert sorted(s.index for s in batch) == list(range(lo, lo + len(batch)))
            stayed = [s for s in batch if lo <= before[id(s)] < lo + len(batch)]
            assert all(s.index == before[id(s)] for s in stayed)  # inside the run: untouched
        elif op == "truncate" and batches:
            slot = rnd.choice(rnd.choice(batches))
            _, kv, ids = model.rows[id(slot)]
            keep = rnd.randint(0, len(ids))
            pool.truncate(slot, keep)
            model.rows[id(slot)] = (slot, kv[:, :, :keep], ids[:keep])
        elif op == "move" and batches:
            free = [i for i in range(pool.slots)
                    if all(s.index != i for s, _, _ in model.rows.values())]
            if free:
                pool.move(rnd.choice(rnd.choice(batches)), rnd.choice(free))
        model.check()


def test_assign_reorders_empty_slots_only() -> None:
    pool = KVPool(SHAPE, 4)
    a, b = pool.allocate(2)
    pool.assign([b, a], [0, 1])  # b first
    assert (a.index, b.index) == (1, 0)
    Model(pool).fill(a, 2)
    with pytest.raises(ValueError, match="only empty slots"):
        pool.assign([a], [2])


def test_ensure_memory_compares_the_need_with_what_is_available() -> None:
    with pytest.raises(MemoryError, match=r"needs 2\.0 GiB .* 1\.0 GiB"):
        ensure_memory(2 << 30, "test", available=1 << 30)
    ensure_memory(1 << 30, "test", available=2 << 30)  # fits: no error


@pytest.mark.parametrize("layout", ["v2", "v1"])
def test_memory_available_is_lowered_to_the_containers_headroom(
        tmp_path: Path, layout: str) -> None:
    from service.engine.kv_pool import memory_available

    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text("MemTotal: 24000000 kB\nMemAvailable: 20000000 kB\n")
    cgroup = tmp_path / "cgroup"
    files = ({"memory.max": "8589934592\n", "memory.current": "1073741824\n"} if layout == "v2"
             else {"memory/memory.limit_in_bytes": "8589934592\n",
                   "memory/memory.usage_in_bytes": "1073741824\n"})
    for name, text in files.items():
        (cgroup / name).parent.mkdir(parents=True, exist_ok=True)
        (cgroup / name).write_text(text)
    assert memory_available(proc, cgroup) == 8 * 2**30 - 2**30  # limit − usage < MemAvailable
    unlimited = "max\n" if layout == "v2" else "9223372036854771712\n"
    (cgroup / next(iter(files))).write_text(unlimited)
    assert memory_available(proc, cgroup) == 20000000 * 1024  # no limit: MemAvailable
    (cgroup / next(iter(files))).write_text("garbage\n")
    assert memory_available(proc, cgroup) == 20000000 * 1024  # unreadable: MemAvailable
    assert memory_available(tmp_path / "none", tmp_path / "none") is None
