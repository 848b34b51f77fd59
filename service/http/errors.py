"""Error bodies: TGI's ``{"error", "error_type"}`` on TGI routes, OpenAI's on /v1 routes.

Every refusal goes through here so that its shape, status and rejection count agree.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.engine.adapters import UnknownAdapter
from service.engine.control_vectors import UnknownControlVector
from service.engine.scheduler import EngineStopped, QueueFull
from service.http.admission import Overloaded
from service.http.validation import InputError

log = logging.getLogger("attnserve.http")

OPENAI_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
                404: "invalid_request_error", 405: "invalid_request_error",
                413: "invalid_request_error", 422: "invalid_request_error",
                429: "overloaded", 503: "service_unavailable"}


UNPARSABLE_BODY = "There was an error parsing the body"  # FastAPI's HTTPException detail


class ApiError(Exception):
    def __init__(self, status: int, message: str, error_type: str,
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None,
                 openai_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.headers = headers
        self.openai_type = openai_type  # the /v1 body's type, where it is not the status's


class ClientDisconnected(Exception):
    """The client went away before its response was ready; nothing is sent."""


def is_openai_path(path: str) -> bool:
    return path.startswith("/v1/") or path == "/v1"


def error_body(path: str, status: int, message: str, error_type: str,
               param: str | None = None, code: str | None = None,
               openai_type: str | None = None) -> dict[str, Any]:
    if is_openai_path(path):
        kind = openai_type or OPENAI_TYPES.get(status, error_type)
        return {"error": {"message": message, "type": kind,
                          "code": code or error_type, "param": param}}
    return {"error": message, "error_type": error_type}


def error_response(request: Request, error: ApiError) -> JSONResponse:
    body = error_body(request.url.path, error.status, error.message, error.error_type,
                      error.param, error.code, error.openai_type)
    return JSONResponse(body, status_code=error.status, headers=error.headers)


def _reject(request: Request, reason: str) -> None:
    runtime = getattr(request.app.state, "runtime", None)
    if runtime is not None:
        runtime.metrics.record_rejection(reason)


def _field(loc: tuple[Any, ...]) -> str:
    """"body.parameters.top_p" -> "parameters.top_p", dropping pydantic's union-branch tags
    such as "constrained-str" or "list[constrained-str]"."""
    parts = [str(p) for p in loc[1:] if isinstance(p, int) or
             (str(p).isidentifier() and str(p) not in ("str", "int", "float", "bool"))]
    return ".".join(parts) or "body"


def _specificity(error: Any) -> tuple[int, bool]:
    """The deepest error is the most specific one (for a str | list union, the list item);
    at equal depth a broken constraint beats a type mismatch, so an empty or over-long list
    is reported as such rather than as "Input should be a valid string"."""
    return len(error.get("loc", ())), not str(error.get("type", "")).endswith("_type")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        _reject(request, "validation")
        errors = exc.errors()
        first = max(errors, key=_specificity) if errors else {
            "loc": ("body",), "msg": "invalid request"}
        field = _field(tuple(first.get("loc", ())))
        message = f"{field}: {first.get('msg', 'invalid')}"
        if first.get("type") == "json_invalid":
            field, message = "body", f"body is not valid JSON: {first.get('msg', '')}"
        return error_response(request, ApiError(422, message, "validation", param=field,
                                                code="invalid_value"))

    @app.exception_handler(InputError)
    async def input_error(request: Request, exc: InputError) -> JSONResponse:
        _reject(request, "validation")
        return error_response(request, ApiError(422, str(exc), "validation", param=exc.field,
                                                code="invalid_value"))

    @app.exception_handler(QueueFull)
    async def queue_full(request: Request, exc: QueueFull) -> JSONResponse:
        _reject(request, "queue_full")
        return error_response(request, ApiError(429, f"model is overloaded: {exc}",
                                                "overloaded", code="queue_full"))

    @app.exception_handler(Overloaded)
    async def overloaded(request: Request, exc: Overloaded) -> JSONResponse:
        _reject(request, exc.reason)
        return error_response(request, ApiError(429, f"model is overloaded: {exc}",
                                                "overloaded", code=exc.reason,
                                                headers={"Retry-After": "1"}))

    @app.exception_handler(UnknownAdapter)
    async def unknown_adapter(request: Request, exc: UnknownAdapter) -> JSONResponse:
        # unloaded between the route's check and the engine's submit: the same 404
        name = str(exc.args[0]) if exc.args else ""
        if is_openai_path(request.url.path):
            return error_response(request, ApiError(
                404, f"The model `{name}` does not exist.", "not_found", param="model",
                code="model_not_found", openai_type="NotFoundError"))
        return error_response(request, ApiError(
            404, f"parameters.adapter_id: adapter {name!r} is not served by this server",
            "not_found", param="parameters.adapter_id", code="model_not_found"))

    @app.exception_handler(UnknownControlVector)
    async def unknown_control_vector(request: Request, exc: UnknownControlVector
                                     ) -> JSONResponse:
        # unloaded between the route's check and the engine's submit: the same 404
        field = "control_vector" if is_openai_path(request.url.path) \
            else "parameters.control_vector"
        return error_response(request, unknown_vector(str(exc.args[0]) if exc.args else "",
                                                      field))

    @app.exception_handler(EngineStopped)
    async def stopped(request: Request, exc: EngineStopped) -> JSONResponse:
        return error_response(request, ApiError(503, str(exc), "unhealthy"))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug still answers in the route's error shape, not Starlette's text/plain 500.
        log.error("unhandled %s on %s: %s", type(exc).__name__, request.url.path, exc)
        return error_response(request, ApiError(500, f"internal error: {type(exc).__name__}",
                                                "internal", code="internal_error"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == UNPARSABLE_BODY:
            # FastAPI's catch-all for bodies json.loads fails on other than by syntax.
            _reject(request, "validation")
            cause = exc.__cause__
            why = ("it is not UTF-8 text" if isinstance(cause, UnicodeDecodeError)
                   else "it is nested too deeply" if isinstance(cause, RecursionError)
                   else f"{type(cause).__name__}: {cause}")
            return error_response(request, ApiError(
                422, f"body is not valid JSON: {why}", "validation", param="body",
                code="invalid_value"))
        error_type = {404: "not_found", 405: "method_not_allowed",
                      413: "too_large"}.get(exc.status_code, "http")
        return error_response(request, ApiError(exc.status_code, str(exc.detail), error_type,
                                                headers=getattr(exc, "headers", None)))


def unknown_vector(name: str, field: str) -> ApiError:
    """The 404 for a control vector this server does not serve, naming the field."""
    return ApiError(404, f"{field}.name: control vector {name!r} is not served by this "
                         "server", "not_found", param=f"{field}.name",
                    code="control_vector_not_found", openai_type="NotFoundError")
