"""FastAPI dependencies: the runtime, readiness, and the optional API key."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from service.http.errors import ApiError
from service.http.runtime import Runtime


def get_runtime(request: Request) -> Runtime:
    runtime: Runtime | None = request.app.state.runtime
    if runtime is None:
        raise ApiError(503, "the server is starting", "unhealthy")
    return runtime


def ready_runtime(runtime: Annotated[Runtime, Depends(get_runtime)]) -> Runtime:
    if runtime.draining:
        raise ApiError(503, "the server is shutting down", "unhealthy")
    if not runtime.ready:
        message = ("the model failed to load" if runtime.load_error
                   else "the model is loading; retry when /ready answers 200")
        raise ApiError(503, message, "unhealthy", headers={"Retry-After": "1"})
    return runtime


def require_api_key(request: Request,
                    runtime: Annotated[Runtime, Depends(get_runtime)]) -> None:
    """Bearer auth with a constant-time comparison, when ATTNSERVE_API_KEY is set."""
    key = runtime.settings.api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    expected = key.get_secret_value().encode()
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
        runtime.metrics.record_rejection("unauthorized")
        raise ApiError(401, "missing or invalid API key (Authorization: Bearer <key>)",
                       "unauthorized", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]
ReadyRuntime = Annotated[Runtime, Depends(ready_runtime)]
