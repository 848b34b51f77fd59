"""OpenAI chat completions: POST /v1/chat/completions, plain or streamed.

The conversation is rendered with the model's chat template (service/contract/chat_template.py)
and tokenized without adding special tokens (the template places them), as vLLM does;
from there a chat request is a completion request with chat-shaped output.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from service.engine.request import TokenEvent, TokenInfo
from service.http.deps import ReadyRuntime, require_api_key
from service.http.errors import ApiError
from service.http.openai_requests import (
    OPENAI_ERRORS,
    chat_requests,
    error_chunk,
    final_text,
    finish_reason,
    served_name,
    stream_pieces,
    usage,
)
from service.http.openai_schemas import ChatCompletionRequest
from service.http.relay import collect, sse
from service.http.responses import ChatCompletion, json_or_sse
from service.http.runtime import Runtime

router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[Depends(require_api_key)])


def token_logprob(info: TokenInfo, top: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"token": info.text, "logprob": info.logprob,
                             "bytes": list(info.text.encode("utf-8"))}
    if top:
        entry["top_logprobs"] = [{"token": text, "logprob": lp,
                                  "bytes": list(text.encode("utf-8"))}
                                 for _, text, lp in info.top]
    return entry


def logprobs_json(tokens: list[TokenEvent]) -> dict[str, Any]:
    return {"content": [token_logprob(e.token, True) for e in tokens], "refusal": None}


@router.post("/chat/completions", summary="OpenAI chat completions, plain or streamed",
             responses={**json_or_sse(ChatCompletion, "A chat completion, or its chunks when "
                                                      "streamed"), **OPENAI_ERRORS})
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           runtime: ReadyRuntime) -> Any:
    requests = chat_requests(body, runtime)
    assert runtime.engine is not None
    handles = runtime.engine.submit(requests)
    chat_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        return StreamingResponse(stream(body, runtime, handles, chat_id, created),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    results = await collect(handles, request)
    choices = [{"index": i,
                "message": {"role": "assistant", "content": final_text(r.finish)},
                "logprobs": logprobs_json(r.tokens) if body.logprobs else None,
                "finish_reason": finish_reason(r.finish)}
               for i, r in enumerate(results)]
    prompt_tokens = len(requests[0].prompt_ids)
    completion_tokens = sum(r.finish.generated_tokens for r in results)
    return JSONResponse({"id": chat_id, "object": "chat.completion", "created": created,
                         "model": served_name(requests, runtime), "choices": choices,
                         "usage": usage(prompt_tokens, completion_tokens)})


async def stream(body: ChatCompletionRequest, runtime: Runtime, handles: list[Any],
                 chat_id: str, created: int) -> AsyncIterator[bytes]:
    """OpenAI's chunk sequence: a role delta per choice, content deltas, a last delta with
    finish_reason, then (stream_options.include_usage) a usage chunk with no choices."""
    model = served_name([h.request for h in handles], runtime)
    def chunk(index: int, delta: dict[str, Any], event: TokenEvent | None,
              reason: str | None) -> bytes:
        payload: dict[str, Any] = {
            "id": chat_id, "object": "chat.completion.chunk", "created": created,
            "model": model,
            "choices": [{"index": index, "delta": delta,
                         "logprobs": logprobs_json([event])
                         if event is not None and body.logprobs else None,
                         "finish_reason": reason}]}
        if body.include_usage:
            payload["usage"] = None
        return sse(payload)

    completion_tokens = 0
    try:
        for i in range(len(handles)):
            yield chunk(i, {"role": "assistant", "content": ""}, None, None)
        async for piece in stream_pieces(handles, body.stop_sequences):
            if piece.event.finish is not None:
                completion_tokens += piece.event.finish.generated_tokens
            last = piece.reason is not None
            yield chunk(piece.choice, {"content": piece.text} if piece.text or not last else {},
                        piece.event, piece.reason)
        if body.include_usage:
            yield sse({"id": chat_id, "object": "chat.completion.chunk", "created": created,
                       "model": model, "choices": [],
                       "usage": usage(len(handles[0].request.prompt_ids), completion_tokens)})
        yield sse("[DONE]")
    except ApiError as exc:
        yield error_chunk(exc)
