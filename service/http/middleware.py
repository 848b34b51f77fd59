"""ASGI middleware: request ids, request-body size limit, per-route request counts and latency.

Written against raw ASGI rather than BaseHTTPMiddleware so streaming responses pass
through untouched and their latency covers the whole stream. A response that never
completes because the client left is counted with status 499. Every request gets an
X-Request-Id (the client's, or a new one) on its response and on the log lines written
while it runs, including one access line per model request.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.http import request_id
from service.http.errors import ClientDisconnected, error_body
from service.http.metrics import Metrics

ROUTES = frozenset({"/", "/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions",
                    "/v1/models", "/tokenize", "/detokenize", "/attention", "/health",
                    "/ready", "/info", "/metrics", "/viz"})
QUIET = frozenset({"/health", "/ready", "/metrics"})  # probes and scrapers: no access line
log = logging.getLogger("attnserve.access")


class BodyTooLarge(StarletteHTTPException):
    """Raised from receive(); an HTTPException so FastAPI's body parsing passes it on."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds max_body_bytes {limit}")


def route_label(path: str) -> str:
    return path if path in ROUTES else "other"


class ObservabilityMiddleware:
    def __init__(self, app: ASGIApp, metrics: Callable[[], Metrics | None],
                 max_body_bytes: int) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        path: str = scope["path"]
        state = {"status": 0, "complete": False, "received": 0, "recorded": False}
        rid = request_id.resolve(_header(scope, b"x-request-id"))
        token = request_id.current.set(rid)
        rid_header = (b"x-request-id", rid.encode())

        async def limited_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                state["received"] += len(message.get("body", b""))
                if state["received"] > self.max_body_bytes:
                    self._count_rejection()
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        def record(status: str) -> None:
            """Count the request once: its route, status, latency and access line."""
            if state["recorded"]:
                return
            state["recorded"] = True
            elapsed = time.perf_counter() - start
            metrics = self.metrics()
            if metrics is not None:
                metrics.record_http(route_label(path), status, elapsed)
            if path not in QUIET:
                log.info("%s %s %s %.1f ms", scope.get("method", ""), path, status,
                         elapsed * 1000)

        async def observed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
                message = {**message, "headers": [*message.get("headers", []), rid_header]}
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                state["complete"] = True
                # Counted before the last byte leaves: a client that scrapes /metrics
                # right after this response must find it counted.
                record(str(state["status"]))
            await send(message)

        try:
            length = _content_length(scope)
            if length is not None and length > self.max_body_bytes:
                self._count_rejection()
                await self._too_large(path, observed_send)
                return
            await self.app(scope, limited_receive, observed_send)
            record("499")  # no complete response: the client left first
        except ClientDisconnected:
            record("499")
        except BaseException:
            record("500")
            raise
        finally:
            request_id.current.reset(token)

    def _count_rejection(self) -> None:
        metrics = self.metrics()
        if metrics is not None:
            metrics.record_rejection("too_large")

    async def _too_large(self, path: str, send: Send) -> None:
        body = json.dumps(error_body(path, 413, f"request body exceeds max_body_bytes "
                                     f"{self.max_body_bytes}", "too_large",
                                     code="body_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, key: bytes) -> str | None:
    for name, value in scope.get("headers", []):
        if name == key:
            return bytes(value).decode("latin-1")
    return None


def _content_length(scope: Scope) -> int | None:
    value = _header(scope, b"content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
