"""Response bodies, for the OpenAPI document: every route states what it answers, with
which status and content type. Routes build their JSON directly (no response_model
re-validation on the hot path); the schemathesis test checks the two agree.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

# -- errors --------------------------------------------------------------------------------


class TgiError(BaseModel):
    """TGI's error body (every route outside /v1)."""

    error: str = Field(description="what went wrong; a validation error starts with the field")
    error_type: str = Field(description="validation, overloaded, unhealthy, generation, "
                                        "unauthorized, not_found, too_large, ...")


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    code: str | None
    param: str | None = Field(description="the offending field, dotted (messages.0.role)")


class OpenAIError(BaseModel):
    """OpenAI's error body (the /v1 routes)."""

    error: OpenAIErrorDetail


ERROR_DESCRIPTIONS = {
    400: "The LoRA adapter was not loaded: the message says why (outside lora_dir, not a "
         "PEFT LoRA adapter, does not fit the model, name taken)",
    401: "Missing or wrong API key (only when the server has one)",
    404: "Unknown model name or LoRA adapter",
    409: "The LoRA adapter still had requests in flight after drain_timeout: it takes no "
         "new ones and leaves once they finish",
    413: "Request body over max_body_bytes",
    422: "Invalid request: the message names the field (bounds that depend on tokens, such "
         "as prompt length or prompt + max_new_tokens, are checked here too)",
    424: "The model failed during generation",
    429: "Too many requests waiting",
    501: "The attention model does not apply LoRA adapters (yet)",
    503: "Loading, draining or shutting down",
}


def errors(model: type[BaseModel], *statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": model, "description": ERROR_DESCRIPTIONS[s]} for s in statuses}


def tgi_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return errors(TgiError, *statuses)


def openai_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return errors(OpenAIError, *statuses)


SSE_NOTE = "Server-Sent Events: `data: <json>` lines, one per token"


def sse_content(description: str) -> dict[str, Any]:
    return {"text/event-stream": {"schema": {"type": "string", "description": description}}}


# -- TGI -----------------------------------------------------------------------------------


class Token(BaseModel):
    id: int
    text: str
    logprob: float | None
    special: bool


class PrefillToken(BaseModel):
    id: int
    text: str
    logprob: float | None


FinishReason = Literal["length", "eos_token", "stop_sequence"]


class Details(BaseModel):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] | None = Field(
        None, description="with top_n_tokens: the most likely tokens at each position")


class GenerateResponse(BaseModel):
    generated_text: str
    details: Details | None = None


class StreamDetails(BaseModel):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None
    input_length: int


class StreamResponse(BaseModel):
    """One SSE event of /generate_stream."""

    index: int
    token: Token
    top_tokens: list[Token] | None
    generated_text: str | None
    details: StreamDetails | None


class TgiToken(BaseModel):
    id: int
    text: str
    start: int
    stop: int


# -- vLLM tokenize -------------------------------------------------------------------------


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


# -- OpenAI --------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    logprob: float | None  # type: ignore[assignment]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChunk(BaseModel):
    """One SSE event of a streamed /v1/completions (the usage event has no choices)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class ChatCompletionChunk(BaseModel):
    """One SSE event of a streamed /v1/chat/completions."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    root: str | None = Field(description="the base's artifact directory; an adapter's own "
                                         "directory")
    parent: str | None = Field(description="a LoRA adapter's base model (its id); null for "
                                           "the base")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


# -- operations ----------------------------------------------------------------------------


class Status(BaseModel):
    status: str
    error: str | None = None


def json_or_sse(model: type[BaseModel], description: str) -> dict[int | str, dict[str, Any]]:
    """200 of a route that streams when the body says ``stream``: JSON or SSE."""
    return {200: {"model": model, "description": description,
                  "content": sse_content(SSE_NOTE + "; the last one is `data: [DONE]`")}}
