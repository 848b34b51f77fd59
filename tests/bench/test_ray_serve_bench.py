"""benchmarks/ray_serve.py's adapter figures, on request logs written out by hand."""

from __future__ import annotations

from benchmarks.ray_serve import landing


def test_a_request_lands_on_a_holder_when_its_replica_served_that_adapter_before() -> None:
    served = [(-2, "a", "r1"), (-1, "b", "r2"),  # the warm-up: each adapter alone
              (0, "a", "r1"),  # r1 holds a
              (1, "b", "r1"),  # r1 never served b: a miss, and b is now on two replicas
              (2, "a", "r3"),  # a miss: a on r1 and r3
              (3, "b", "r1")]  # r1 has served b (request 1): a hit
    figures = landing(served, ["a", "b", "c"])
    assert figures["requests_after_warmup"] == 4
    assert figures["landing_on_holder"] == 0.5
    assert figures["replicas_per_adapter"] == {"a": 2, "b": 2, "c": 0}


def test_no_request_after_the_warm_up_gives_no_share() -> None:
    assert landing([(-1, "a", "r1")], ["a"])["landing_on_holder"] is None
