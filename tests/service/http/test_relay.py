"""The relay between engine events and HTTP, without a model: handles fed by hand.

Events are delivered to real RequestHandles on the event loop the way the scheduler's
thread delivers them (``call_soon``); the client is a stand-in ASGI ``receive`` that
either never says anything or disconnects.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from service.engine.request import (
    ErrorEvent,
    FinishInfo,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
    TokenEvent,
    TokenInfo,
)
from service.engine.scheduler import RequestHandle
from service.http.errors import ApiError, ClientDisconnected
from service.http.relay import collect, merge, sse


class Wakes:
    """The scheduler's side of ``RequestHandle.cancel``: counts wake-ups."""

    def __init__(self) -> None:
        self.count = 0

    def wake(self) -> None:
        self.count += 1


class Client:
    """An ASGI request whose ``receive`` disconnects when told to (or never)."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}


def handle(prompt: list[int]) -> RequestHandle:
    request = GenerationRequest(prompt, SamplingParams(), StoppingCriteria(8))
    return RequestHandle(request, Wakes())  # type: ignore[arg-type]


def token(i: int, last: bool = False) -> TokenEvent:
    finish = FinishInfo("length", "text", i + 1, None, None, None, (), 0.0, 0.0) if last else None
    return TokenEvent(TokenInfo(100 + i, f"t{i}", -0.5), i, finish)


def deliver(h: RequestHandle, *events: TokenEvent | ErrorEvent) -> None:
    loop = asyncio.get_running_loop()
    for e in events:
        loop.call_soon(h.deliver, e)


def test_collect_returns_every_result_in_handle_order() -> None:
    async def main() -> None:
        a, b = handle([1, 2, 3]), handle([4])
        deliver(b, token(0), token(1, last=True))  # b finishes first
        deliver(a, token(0), token(1), token(2, last=True))
        done = await collect([a, b], Client())  # type: ignore[arg-type]
        assert [len(d.tokens) for d in done] == [3, 2]
        assert [d.prompt_tokens for d in done] == [3, 1]
        assert done[0].finish.generated_tokens == 3
        assert [t.token.id for t in done[0].tokens] == [100, 101, 102]

    asyncio.run(main())


@pytest.mark.parametrize(("kind", "status"), [("generation", 424), ("shutdown", 503)])
def test_an_engine_error_becomes_its_http_status(kind: str, status: int) -> None:
    async def main() -> None:
        h = handle([1])
        deliver(h, token(0), ErrorEvent("boom", kind))  # type: ignore[arg-type]
        with pytest.raises(ApiError) as info:
            await collect([h], Client())  # type: ignore[arg-type]
        assert info.value.status == status and info.value.message == "boom"

    asyncio.run(main())


def test_a_disconnect_cancels_every_request_of_the_response() -> None:
    async def main() -> None:
        a, b = handle([1]), handle([2])
        client = Client()
        deliver(a, token(0))  # a is mid-generation, b has not started
        task = asyncio.ensure_future(collect([a, b], client))  # type: ignore[arg-type]
        await asyncio.sleep(0)
        client.gone.set()
        with pytest.raises(ClientDisconnected):
            await task
        assert a.request.cancelled.is_set() and b.request.cancelled.is_set()

    asyncio.run(main())


def test_merge_tags_every_event_keeps_each_streams_order_and_ends_with_the_last_finish(
        ) -> None:
    async def main() -> list[tuple[int, int]]:
        a, b = handle([1]), handle([2])
        deliver(a, token(0))
        deliver(b, token(0))
        events = merge([a, b])
        seen = [(i, e.index) for i, e in [await anext(events), await anext(events)]]
        deliver(a, token(1, last=True))  # a ends; b goes on
        deliver(b, token(1), token(2, last=True))
        seen += [(i, e.index) async for i, e in events]
        assert a.request.cancelled.is_set() and b.request.cancelled.is_set()  # closed after
        return seen

    seen = asyncio.run(main())
    assert sorted(seen[:2]) == [(0, 0), (1, 0)]
    assert sorted(seen) == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    for stream in (0, 1):
        order = [index for i, index in seen if i == stream]
        assert order == sorted(order)
    assert seen[-1] == (1, 2)


def test_merge_raises_the_first_error() -> None:
    async def main() -> None:
        a, b = handle([1]), handle([2])
        deliver(a, token(0))
        deliver(b, ErrorEvent("bad row"))
        events = merge([a, b])
        assert (await anext(events))[0] == 0
        with pytest.raises(ApiError, match="bad row"):
            await anext(events)

    asyncio.run(main())


def test_sse_frames_json_and_text() -> None:
    frame = sse({"token": {"text": "é"}})
    assert frame.endswith(b"\n\n") and frame.startswith(b"data: ")
    assert json.loads(frame[6:].decode()) == {"token": {"text": "é"}}
    assert sse("[DONE]") == b"data: [DONE]\n\n"
