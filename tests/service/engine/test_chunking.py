"""The adaptive prefill-chunk budget against hand-computed figures."""

from __future__ import annotations

import pytest

from service.engine.chunking import (
    MIN_CHUNK_TOKENS,
    MIN_MIXED_CHUNK_TOKENS,
    MIXED_SHARE,
    ChunkBudget,
)


def test_fixed_budget_always_takes_the_maximum() -> None:
    budget = ChunkBudget(256, adaptive=False)
    budget.observe_decode(0.030)
    budget.observe_chunk(256, 0.5)
    assert budget.next_chunk(running=True, left=900) == 256
    assert budget.next_chunk(running=False, left=900) == 256


def test_alone_the_rest_goes_in_one_pass() -> None:
    assert ChunkBudget(256).next_chunk(running=False, left=1000) == 1000


def test_a_chunk_costs_about_one_decode_step() -> None:
    budget = ChunkBudget(256, smoothing=1.0)  # no smoothing: the last figures
    assert budget.next_chunk(running=True, left=1000) == MIN_CHUNK_TOKENS  # nothing measured
    budget.observe_decode(0.030)  # 30 ms a step
    budget.observe_chunk(16, 0.008)  # 0.5 ms a prompt token
    assert budget.next_chunk(running=True, left=1000) == 60  # 30 / 0.5
    budget.observe_chunk(60, 0.300)  # 5 ms a token: a slow machine
    assert budget.next_chunk(running=True, left=1000) == MIN_CHUNK_TOKENS  # floor
    budget.observe_chunk(16, 0.0001)  # very cheap tokens
    assert budget.next_chunk(running=True, left=1000) == 256  # ceiling


def test_estimates_are_smoothed() -> None:
    budget = ChunkBudget(256, smoothing=0.5)
    budget.observe_decode(0.020)
    budget.observe_decode(0.040)  # 0.020 + 0.5 × (0.040 − 0.020)
    budget.observe_chunk(10, 0.010)
    budget.observe_chunk(10, 0.030)  # 0.001 + 0.5 × (0.003 − 0.001) per token
    assert budget.decode_s == pytest.approx(0.030)
    assert budget.token_s == pytest.approx(0.002)
    assert budget.next_chunk(running=True, left=1000) == MIN_CHUNK_TOKENS  # 15 → floor 16


def test_a_chunk_riding_in_a_decode_step_costs_about_half_a_step_beyond_it() -> None:
    """Mixed passes: a chunk's cost is what the step took beyond a plain decode step, and
    the chunk is sized for MIXED_SHARE of a step."""
    budget = ChunkBudget(256, smoothing=1.0, mixed=True)
    budget.observe_mixed(16, 0.050)  # no plain step measured yet: nothing to subtract from
    assert budget.token_s is None
    budget.observe_decode(0.030)
    budget.observe_mixed(16, 0.038)  # 8 ms beyond the step: 0.5 ms a token
    assert budget.token_s == pytest.approx(0.0005)
    assert budget.next_chunk(running=True, left=1000) == int(0.030 * MIXED_SHARE / 0.0005)
    budget.observe_mixed(40, 0.025)  # faster than a plain step (noise): free, not negative
    assert budget.token_s == 0.0
    assert budget.next_chunk(running=True, left=1000) == MIN_MIXED_CHUNK_TOKENS  # again
