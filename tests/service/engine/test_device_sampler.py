"""The GPU's sampler (service/engine/cuda.py), run on the CPU: temperature, top-k and
top-p draws equal service/engine/sampling.py's host sampler given the same seeded draws."""

from __future__ import annotations

import numpy as np
import pytest

from service.engine.cuda import DeviceSampler, SampledRows
from service.engine.request import SamplingParams
from service.engine.sampling import RowSampler

PARAMS = [SamplingParams(do_sample=True, seed=1),
          SamplingParams(do_sample=True, temperature=0.7, seed=2),
          SamplingParams(do_sample=True, top_k=5, seed=3),
          SamplingParams(do_sample=True, top_p=0.8, seed=4),
          SamplingParams(do_sample=True, temperature=1.3, top_k=40, top_p=0.9, seed=5),
          SamplingParams(do_sample=True, temperature=0.2, top_p=0.5, seed=6)]


@pytest.fixture(scope="module")
def sampler() -> DeviceSampler:
    return DeviceSampler(device="cpu")


def rows_of(params: list[SamplingParams], draws: list[float], vocab: int) -> SampledRows:
    return SampledRows(
        temperature=np.array([p.temperature for p in params], np.float32),
        top_k=np.array([p.top_k if p.top_k > 0 else vocab for p in params], np.int64),
        top_p=np.array([p.top_p if p.top_p < 1.0 else 2.0 for p in params], np.float32),
        u=np.array(draws, np.float32))


@pytest.mark.parametrize("vocab", [50, 1000])
def test_draws_equal_the_host_samplers(sampler: DeviceSampler, vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    host = [RowSampler(p, vocab, []) for p in PARAMS]
    twins = [np.random.default_rng(p.seed) for p in PARAMS]  # the same draws, for the GPU's
    for _ in range(60):
        logits = (rng.standard_normal((len(PARAMS), vocab)) * 3).astype(np.float32)  # (B, V)
        want = [s.choose(row) for s, row in zip(host, logits, strict=True)]
        got = sampler.sample(logits, rows_of(PARAMS, [t.random() for t in twins], vocab))
        assert got.tolist() == want


def test_padding_rows_and_greedy_rows(sampler: DeviceSampler) -> None:
    """A bucket's padding rows are drawn and dropped; top-k 1 is the argmax."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 30)).astype(np.float32)  # (b, V): 2 rows, 2 padding
    rows = SampledRows(temperature=np.ones(2, np.float32), top_k=np.ones(2, np.int64),
                       top_p=np.full(2, 2.0, np.float32), u=np.array([0.3, 0.9], np.float32))
    assert sampler.sample(logits, rows).tolist() == logits[:2].argmax(-1).tolist()


def test_ties_at_the_kth_value_stay_as_on_the_host(sampler: DeviceSampler) -> None:
    """Logits rounded to tenths (float16 logits tie often): top-k keeps every token equal
    to the k-th value, as the host's threshold does."""
    rng = np.random.default_rng(7)
    params = [SamplingParams(do_sample=True, top_k=k, seed=20 + k) for k in (1, 3, 8)]
    host = [RowSampler(p, 40, []) for p in params]
    twins = [np.random.default_rng(p.seed) for p in params]
    for _ in range(80):
        logits = np.round(rng.standard_normal((3, 40)), 1).astype(np.float32)  # (B, V)
        want = [s.choose(row) for s, row in zip(host, logits, strict=True)]
        got = sampler.sample(logits, rows_of(params, [t.random() for t in twins], 40))
        assert got.tolist() == want
