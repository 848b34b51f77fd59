"""/openapi.json as this server answers: the static document FastAPI builds from the
schemas, plus what only the running server knows.

* Token bounds from the resolved limits (``max_new_tokens``, ``max_tokens``,
  ``max_completion_tokens``, ``min_tokens``, ``truncate``) and token ids (the vocabulary)
  become ``maximum``s.
* ``model`` fields name the served model and its LoRA adapters (``enum``): another name
  is a 404. A run-time load or unload drops the cached document (routes/lora.py).
* With an API key, a bearer security scheme on every route that needs it; without one,
  none (the document does not ask clients for a key the server ignores).

Bounds that count tokens of the prompt cannot be expressed in JSON Schema; those are
the 422s the document describes in words.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from service.http.responses import (
    ChatCompletionChunk,
    CompletionChunk,
    OpenAIError,
    StreamResponse,
    TgiError,
)
from service.http.runtime import Runtime

# (component schema, property) → which resolved limit bounds it
TOKEN_BOUNDS: dict[tuple[str, str], str] = {
    ("GenerateParameters", "max_new_tokens"): "max_new_tokens",
    ("GenerateParameters", "truncate"): "max_input_tokens",
    ("CompletionRequest", "max_tokens"): "max_new_tokens",
    ("CompletionRequest", "min_tokens"): "max_new_tokens",
    ("ChatCompletionRequest", "max_tokens"): "max_new_tokens",
    ("ChatCompletionRequest", "max_completion_tokens"): "max_new_tokens",
    ("ChatCompletionRequest", "min_tokens"): "max_new_tokens",
}
# (component schema, property) whose items are token ids, bounded by the vocabulary
TOKEN_ID_LISTS = (("DetokenizeRequest", "tokens"), ("CompletionRequest", "stop_token_ids"),
                  ("ChatCompletionRequest", "stop_token_ids"))
MODEL_FIELDS = ("CompletionRequest", "ChatCompletionRequest", "PromptTokenizeRequest",
                "ChatTokenizeRequest", "DetokenizeRequest")
PUBLIC = frozenset({"/health", "/ready", "/metrics", "/viz"})
# (path, method) → (the event payload models, whether the stream ends with "data: [DONE]")
STREAMS: dict[tuple[str, str], tuple[tuple[type[BaseModel], ...], bool]] = {
    ("/generate_stream", "post"): ((StreamResponse, TgiError), False),
    ("/", "post"): ((StreamResponse, TgiError), False),
    ("/v1/completions", "post"): ((CompletionChunk, OpenAIError), True),
    ("/v1/chat/completions", "post"): ((ChatCompletionChunk, OpenAIError), True),
}


def _add_stream_schemas(schema: dict[str, Any]) -> None:
    """Each SSE event as OpenAPI 3.1 describes one (``schema`` of text/event-stream is one
    event): its ``data`` is JSON of the payload models, or the final ``[DONE]``."""
    models = sorted({m for payload, _ in STREAMS.values() for m in payload},
                    key=lambda m: m.__name__)
    _, definitions = models_json_schema([(m, "serialization") for m in models],
                                        ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name, definition in definitions.get("$defs", {}).items():
        components.setdefault(name, definition)
    for (path, method), (payload, done) in STREAMS.items():
        operation = schema["paths"].get(path, {}).get(method)
        if operation is None:
            continue
        data: dict[str, Any] = {
            "type": "string", "contentMediaType": "application/json",
            "contentSchema": {"anyOf": [{"$ref": f"#/components/schemas/{m.__name__}"}
                                        for m in payload]}}
        if done:
            data = {"anyOf": [{"const": "[DONE]"}, data]}
        event = {"type": "object", "required": ["data"], "properties": {"data": data},
                 "description": "one Server-Sent Event"}
        operation["responses"]["200"]["content"]["text/event-stream"]["schema"] = event


def _bound(prop: dict[str, Any], maximum: int) -> None:
    for member in prop.get("anyOf", [prop]):
        if member.get("type") == "integer":
            member["maximum"] = maximum


def _drop_default_422(schema: dict[str, Any]) -> None:
    """FastAPI documents a 422 of its own body shape on every operation with parameters;
    routes with a body list their real 422 instead, so what is left (a str path
    parameter, which cannot fail) is dropped, with its unused schemas."""
    for operations in schema["paths"].values():
        for operation in operations.values():
            default = operation["responses"].get("422", {})
            ref = default.get("content", {}).get("application/json", {}).get("schema", {})
            if ref.get("$ref", "").endswith("/HTTPValidationError"):
                del operation["responses"]["422"]
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)


def build(app: FastAPI, runtime: Runtime | None) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, description=app.description,
                         routes=app.routes)
    _add_stream_schemas(schema)
    _drop_default_422(schema)
    if runtime is None:
        return schema
    components = schema.get("components", {}).get("schemas", {})
    limits = runtime.artifact.limits
    for (component, name), limit in TOKEN_BOUNDS.items():
        prop = components.get(component, {}).get("properties", {}).get(name)
        if prop is not None:
            _bound(prop, getattr(limits, limit))
    names = [runtime.artifact.name, *runtime.adapter_names()]
    for component in MODEL_FIELDS:  # the served names; any other is a 404
        prop = components.get(component, {}).get("properties", {}).get("model")
        for member in (prop or {}).get("anyOf", [prop or {}]):
            if member.get("type") == "string":
                member["enum"] = names
    vocab = runtime.artifact.config.vocab_size
    for component, name in TOKEN_ID_LISTS:
        prop = components.get(component, {}).get("properties", {}).get(name)
        for member in (prop or {}).get("anyOf", [prop or {}]):
            if member.get("type") == "array":
                member["items"]["maximum"] = vocab - 1
    if runtime.settings.api_key is not None:
        schema.setdefault("components", {})["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer",
                       "description": "ATTNSERVE_API_KEY"}}
        for path, operations in schema["paths"].items():
            if path in PUBLIC:
                continue
            for operation in operations.values():
                operation["security"] = [{"bearer": []}]
    return schema


def install(app: FastAPI) -> None:
    """Serve ``build``'s document, computed once the runtime exists."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        runtime: Runtime | None = app.state.runtime
        document = build(app, runtime)
        if runtime is not None:
            app.openapi_schema = document
        return document

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented override

