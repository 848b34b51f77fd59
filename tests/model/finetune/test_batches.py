"""model/finetune/batches.py: length-grouped micro-batches and how steps take them.

Properties are checked on the output alone: every index once an epoch, batch sizes,
determinism per (seed, epoch), sorted batches, and length ranges that overlap at most as
many times as there are windows of ``GROUP`` batches (batches of one window are cut from
one sorted run, so their ranges never overlap); the plan's steps against slices of the
concatenated epochs, computed here.
"""

from __future__ import annotations

import math
import random

import pytest

from model.finetune.batches import GROUP, BatchPlan, epoch_batches


def distinct_lengths(n: int, seed: int = 0) -> list[int]:
    """n different lengths in a random order (so that length ranges compare strictly)."""
    lengths = list(range(10, 10 + 3 * n, 3))
    random.Random(seed).shuffle(lengths)
    return lengths


def depth(batches: list[list[int]], lengths: list[int]) -> int:
    """The most batches whose [shortest, longest] length ranges share one length."""
    ranges = [(min(lengths[i] for i in b), max(lengths[i] for i in b)) for b in batches]
    return max(sum(lo <= x <= hi for lo, hi in ranges) for x in set(lengths))


@pytest.mark.parametrize(("n", "batch_size"), [(1, 4), (13, 4), (40, 8), (41, 1), (230, 2)])
def test_every_index_once_per_epoch_in_batches_of_at_most_batch_size(n: int,
                                                                     batch_size: int) -> None:
    lengths = distinct_lengths(n)
    for epoch in range(3):
        batches = epoch_batches(lengths, batch_size, seed=7, epoch=epoch)
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(n))
        assert all(1 <= len(b) <= batch_size for b in batches)
        window = batch_size * GROUP  # examples sorted together
        full, rest = divmod(n, window)
        expected = full * GROUP + math.ceil(rest / batch_size)
        assert len(batches) == expected
        # one short batch at most per window (the end of its sorted run)
        assert sum(len(b) < batch_size for b in batches) <= full + (rest > 0)


def test_empty_dataset_gives_no_batches() -> None:
    assert epoch_batches([], 4, seed=0, epoch=0) == []


def test_same_seed_and_epoch_same_batches_else_another_order() -> None:
    lengths = distinct_lengths(60)
    first = epoch_batches(lengths, 4, seed=1, epoch=0)
    assert epoch_batches(list(lengths), 4, seed=1, epoch=0) == first
    assert epoch_batches(lengths, 4, seed=1, epoch=1) != first
    other = epoch_batches(lengths, 4, seed=2, epoch=0)
    assert other != first
    # 60 examples fit one window, sorted whatever the shuffle: the same batches, reordered
    assert sorted(other) == sorted(first)


@pytest.mark.parametrize(("n", "batch_size"), [(37, 4), (50, 1), (100, 2)])
def test_one_window_is_cut_from_one_sorted_run(n: int, batch_size: int) -> None:
    """All examples in one window: each batch longest first, and the batches' length
    ranges do not overlap, so in order of length they tile the sorted lengths."""
    assert n <= batch_size * GROUP
    lengths = distinct_lengths(n, seed=n)
    batches = epoch_batches(lengths, batch_size, seed=3, epoch=0)
    for b in batches:
        assert [lengths[i] for i in b] == sorted((lengths[i] for i in b), reverse=True)
    assert depth(batches, lengths) == 1
    by_length = sorted(batches, key=lambda b: -lengths[b[0]])
    assert [lengths[i] for b in by_length for i in b] == sorted(lengths, reverse=True)
    assert all(len(b) == batch_size for b in by_length[:-1])  # the shortest batch is short


def test_windows_sort_their_own_examples() -> None:
    """Several windows: batches still sorted, and at any length at most one batch of each
    window spans it; random batches of the same sizes overlap far more."""
    batch_size, n = 2, 2 * GROUP * 3 + 17  # four windows, the last partial
    windows = math.ceil(n / (batch_size * GROUP))
    lengths = distinct_lengths(n, seed=11)
    for epoch in range(2):
        batches = epoch_batches(lengths, batch_size, seed=5, epoch=epoch)
        for b in batches:
            assert lengths[b[0]] >= lengths[b[-1]]
        assert depth(batches, lengths) <= windows
    order = list(range(n))
    random.Random(0).shuffle(order)
    unsorted = [order[i:i + batch_size] for i in range(0, n, batch_size)]
    assert depth(unsorted, lengths) > 3 * windows


def test_equal_lengths_are_fine() -> None:
    lengths = [5] * 9 + [2] * 9
    batches = epoch_batches(lengths, 3, seed=0, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(18))
    assert all(len({lengths[i] for i in b}) == 1 for b in batches)  # 9 of each: no mixing


@pytest.mark.parametrize(("accumulation", "world"), [(1, 1), (3, 1), (2, 2), (1, 4)])
def test_plan_steps_take_consecutive_runs_of_the_stream(accumulation: int, world: int) -> None:
    lengths = distinct_lengths(45, seed=2)
    plan = BatchPlan.build(lengths, batch_size=4, epochs=3, seed=9,
                           accumulation=accumulation, world_size=world)
    stream = [b for e in range(3) for b in epoch_batches(lengths, 4, 9, e)]
    assert plan.batches == stream
    per_step = accumulation * world
    assert plan.steps == len(stream) // per_step == (12 * 3) // per_step
    taken = []
    for k in range(plan.steps):
        step = plan.step(k)
        assert len(step) == per_step
        taken += step
        shares = [plan.rank_share(k, r) for r in range(world)]
        assert all(len(s) == accumulation for s in shares)
        for r, share in enumerate(shares):  # rank r takes every world-th batch of the step
            assert share == [step[j] for j in range(r, per_step, world)]
        flat = sorted(i for s in shares for b in s for i in b)
        assert flat == sorted(i for b in step for i in b)  # the shares partition the step
    assert taken == stream[:plan.steps * per_step]
    assert len(stream) - len(taken) < per_step  # only a last partial step is left out


def test_plan_is_a_function_of_seed_and_step() -> None:
    """A resumed run (a new plan from the same arguments) takes the same batches."""
    lengths = distinct_lengths(30, seed=4)
    args = dict(batch_size=3, epochs=2, seed=1, accumulation=2, world_size=2)
    one, two = BatchPlan.build(lengths, **args), BatchPlan.build(lengths, **args)
    assert [one.rank_share(k, 1) for k in range(one.steps)] == \
        [two.rank_share(k, 1) for k in range(two.steps)]
    other = BatchPlan.build(lengths, **{**args, "seed": 2})
    assert other.batches != one.batches


def test_epoch_of_counts_completed_epochs() -> None:
    lengths = distinct_lengths(24)
    plan = BatchPlan.build(lengths, batch_size=4, epochs=2, seed=0, accumulation=3,
                           world_size=1)  # 6 batches an epoch, 3 a step
    assert [plan.epoch_of(k, 6) for k in range(plan.steps)] == [0.5, 1.0, 1.5, 2.0]
