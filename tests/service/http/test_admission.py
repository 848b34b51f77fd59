"""AdmissionGate on its own: who runs, who waits, who is refused, and what it reports.

Every step is driven by events the test sets, so each assertion holds by construction of
the schedule (asyncio runs one task at a time), never by timing.
"""

from __future__ import annotations

import asyncio

import pytest

from service.http.admission import AdmissionGate, AdmissionStats, Overloaded


async def _enter(gate: AdmissionGate, order: list[str], name: str,
                 release: asyncio.Event) -> None:
    async with gate.admit():
        order.append(name)
        await release.wait()


async def _settle() -> None:
    for _ in range(5):  # let every ready task run up to its next await
        await asyncio.sleep(0)


def test_runs_up_to_the_bound_queues_in_order_and_refuses_the_rest() -> None:
    seen: list[AdmissionStats] = []

    async def scenario() -> None:
        gate = AdmissionGate("/x", max_running=1, max_waiting=2, reason="x_busy",
                             on_change=seen.append)
        order: list[str] = []
        releases = {n: asyncio.Event() for n in "abc"}
        tasks = {n: asyncio.create_task(_enter(gate, order, n, releases[n])) for n in "abc"}
        await _settle()
        assert order == ["a"] and (gate.running, gate.waiting) == (1, 2)
        with pytest.raises(Overloaded) as refused:
            async with gate.admit():
                raise AssertionError("admitted beyond running + waiting")
        assert refused.value.reason == "x_busy"
        assert "1 running, 2 waiting" in str(refused.value)
        releases["a"].set()
        await _settle()
        assert order == ["a", "b"] and (gate.running, gate.waiting) == (1, 1)
        releases["b"].set()
        releases["c"].set()
        await asyncio.gather(*tasks.values())
        assert order == ["a", "b", "c"] and (gate.running, gate.waiting) == (0, 0)

    asyncio.run(scenario())
    assert seen[-1] == AdmissionStats("/x", 0, 0)
    assert max(s.running for s in seen) == 1 and max(s.waiting for s in seen) == 2


def test_a_waiter_that_goes_away_frees_its_place() -> None:
    async def scenario() -> None:
        gate = AdmissionGate("/x", max_running=1, max_waiting=1, reason="x_busy")
        order: list[str] = []
        hold, never = asyncio.Event(), asyncio.Event()
        first = asyncio.create_task(_enter(gate, order, "first", hold))
        waiter = asyncio.create_task(_enter(gate, order, "waiter", never))
        await _settle()
        assert (gate.running, gate.waiting) == (1, 1)
        waiter.cancel()  # the client disconnected while queued
        await _settle()
        assert waiter.cancelled() and (gate.running, gate.waiting) == (1, 0)
        late = asyncio.create_task(_enter(gate, order, "late", asyncio.Event()))
        await _settle()
        assert gate.waiting == 1  # admitted to wait, not refused
        hold.set()
        await _settle()
        assert order == ["first", "late"]
        late.cancel()
        await asyncio.gather(first, late, return_exceptions=True)
        assert (gate.running, gate.waiting) == (0, 0)

    asyncio.run(scenario())


def test_no_queue_refuses_as_soon_as_the_slots_are_taken() -> None:
    async def scenario() -> None:
        gate = AdmissionGate("/x", max_running=2, max_waiting=0, reason="x_busy")
        hold = asyncio.Event()
        tasks = [asyncio.create_task(_enter(gate, [], str(i), hold)) for i in range(2)]
        await _settle()
        with pytest.raises(Overloaded):
            async with gate.admit():
                pass
        hold.set()
        await asyncio.gather(*tasks)
        async with gate.admit():  # the slots came back
            assert gate.running == 1

    asyncio.run(scenario())


@pytest.mark.parametrize(("running", "waiting"), [(0, 0), (1, -1)])
def test_bounds_are_checked(running: int, waiting: int) -> None:
    with pytest.raises(ValueError, match="max_running"):
        AdmissionGate("/x", running, waiting, "x_busy")
