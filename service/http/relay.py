"""Relaying engine events to HTTP: waiting for results, merging streams, client disconnects.

A plain request races its results against the client's ``http.disconnect``; a streaming
response's generator is closed by Starlette when the client goes. Either way the engine
request is cancelled, and its row leaves the batch at the next step.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from service.engine.request import ErrorEvent, FinishInfo, TokenEvent
from service.engine.scheduler import RequestHandle
from service.http.errors import ApiError, ClientDisconnected


@dataclass(frozen=True)
class Completed:
    tokens: list[TokenEvent]
    finish: FinishInfo
    prompt_tokens: int


def engine_error(event: ErrorEvent) -> ApiError:
    if event.kind == "shutdown":
        return ApiError(503, event.message, "unhealthy")
    return ApiError(424, event.message, "generation")


async def _run_one(handle: RequestHandle) -> Completed:
    tokens: list[TokenEvent] = []
    for event in await handle.all_events():
        if isinstance(event, ErrorEvent):
            raise engine_error(event)
        tokens.append(event)
        if event.finish is not None:
            return Completed(tokens, event.finish, len(handle.request.prompt_ids))
    raise ApiError(424, "generation ended without a result", "generation")


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(handles: Sequence[RequestHandle], request: Request) -> list[Completed]:
    """Every handle's result in order; cancel all of them if the client disconnects."""
    results: asyncio.Future[list[Completed]] = asyncio.ensure_future(
        asyncio.gather(*(_run_one(h) for h in handles)))
    watcher: asyncio.Future[Any] = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([results, watcher], return_when=asyncio.FIRST_COMPLETED)
        if not results.done():
            raise ClientDisconnected
        return results.result()
    finally:
        watcher.cancel()
        if not results.done():
            results.cancel()
        for h in handles:
            h.cancel()  # a no-op for finished requests


async def merge(handles: Sequence[RequestHandle]) -> AsyncIterator[tuple[int, TokenEvent]]:
    """Events of several requests as they come, tagged with the request's index."""
    queue: asyncio.Queue[tuple[int, TokenEvent | ErrorEvent]] = asyncio.Queue()

    async def pump(i: int, handle: RequestHandle) -> None:
        async for event in handle.events():
            queue.put_nowait((i, event))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    open_streams = len(handles)
    try:
        while open_streams:
            i, event = await queue.get()
            if isinstance(event, ErrorEvent):
                raise engine_error(event)
            if event.finish is not None:
                open_streams -= 1
            yield i, event
    finally:
        for t in tasks:
            t.cancel()
        for h in handles:
            h.cancel()


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()
