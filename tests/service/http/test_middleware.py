"""The observability middleware on a bare ASGI app: a request is counted before the last
byte of its response leaves, so a scrape that follows a response always counts it."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from service.http.metrics import Metrics
from service.http.middleware import ObservabilityMiddleware


def counted(metrics: Metrics, route: str, status: str) -> float:
    value = metrics.registry.get_sample_value(
        "attnserve_requests_total", {"route": route, "status": status})
    return value or 0.0


def latencies(metrics: Metrics, route: str) -> float:
    value = metrics.registry.get_sample_value(
        "attnserve_e2e_request_latency_seconds_count", {"route": route})
    return value or 0.0


async def streaming_app(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"a", "more_body": True})
    await send({"type": "http.response.body", "body": b"b", "more_body": False})


async def leaving_app(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"a", "more_body": True})
    # the client left: the app returns without a last body message


def run(app: Any, metrics: Metrics, path: str) -> list[tuple[str, float, float]]:
    """Serve one GET of ``path``; for each message the server is asked to send, the
    request count and latency count the metrics held at that moment."""
    middleware = ObservabilityMiddleware(app, lambda: metrics, max_body_bytes=1024)
    seen: list[tuple[str, float, float]] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        seen.append((message["type"] + ("+more" if message.get("more_body") else ""),
                     sum(counted(metrics, path, s) for s in ("200", "499")),
                     latencies(metrics, path)))

    scope = {"type": "http", "path": path, "method": "GET", "headers": []}
    asyncio.run(middleware(scope, receive, send))
    return seen


def test_a_response_is_counted_before_its_last_byte_is_sent() -> None:
    metrics = Metrics()
    seen = run(streaming_app, metrics, "/generate")
    assert seen == [("http.response.start", 0, 0), ("http.response.body+more", 0, 0),
                    ("http.response.body", 1, 1)]
    assert counted(metrics, "/generate", "200") == 1
    run(streaming_app, metrics, "/generate")
    assert counted(metrics, "/generate", "200") == 2  # once a request, not twice


def test_a_response_the_client_left_is_counted_once_as_499() -> None:
    metrics = Metrics()
    run(leaving_app, metrics, "/generate")
    assert counted(metrics, "/generate", "499") == 1
    assert counted(metrics, "/generate", "200") == 0
    assert latencies(metrics, "/generate") == 1
