"""OpenAI-compatible completions: POST /v1/completions, GET /v1/models (what vLLM serves).

The request fields, the stop-sequence hold-back and the finish are shared with chat
(service/http/openai_requests.py); this module shapes the completion objects.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from service.engine.request import FinishInfo, TokenEvent, TokenInfo
from service.http.adapters import model_not_found
from service.http.deps import ReadyRuntime, RuntimeDep, require_api_key
from service.http.errors import ApiError
from service.http.openai_requests import (
    OPENAI_ERRORS,
    completion_requests,
    error_chunk,
    final_text,
    finish_reason,
    served_name,
    stream_pieces,
    usage,
)
from service.http.openai_schemas import CompletionRequest
from service.http.relay import collect, sse
from service.http.responses import Completion, ModelCard, ModelList, json_or_sse, openai_errors
from service.http.runtime import Runtime

router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[Depends(require_api_key)])


def model_cards(runtime: Runtime) -> list[dict[str, Any]]:
    """The base's card, then each served LoRA adapter's (vLLM's: ``parent`` the base's id,
    ``root`` the adapter's directory)."""
    base = runtime.artifact.name
    common = {"object": "model", "created": int(runtime.started_at), "owned_by": "attnserve",
              "max_model_len": runtime.artifact.limits.max_total_tokens}
    cards = [{"id": base, **common, "root": str(runtime.artifact.path), "parent": None}]
    for name in runtime.adapter_names():
        cards.append({"id": name, **common, "root": runtime.adapter_roots.get(name),
                      "parent": base})
    return cards


@router.get("/models", summary="The served model, then each LoRA adapter served over it",
            responses={200: {"model": ModelList}, **openai_errors(401, 503)})
async def list_models(runtime: RuntimeDep) -> dict[str, Any]:
    return {"object": "list", "data": model_cards(runtime)}


@router.get("/models/{model_id}", summary="The card of the served model or of a LoRA adapter",
            responses={200: {"model": ModelCard}, **openai_errors(401, 404, 503)})
async def get_model(model_id: str, runtime: RuntimeDep) -> dict[str, Any]:
    card = next((c for c in model_cards(runtime) if c["id"] == model_id), None)
    if card is None:
        raise model_not_found(model_id)
    return card


def top_json(info: TokenInfo) -> dict[str, float] | None:
    """OpenAI's ``top_logprobs`` entry of one token: the alternatives asked for and the
    token itself (so up to logprobs + 1 entries, as OpenAI and vLLM send); null where the
    token has no logprob (a prompt's first)."""
    if info.logprob is None:
        return None
    top = {text: lp for _, text, lp in info.top}
    named = next((text for i, text, _ in info.top if i == info.id), info.text)
    top[named] = info.logprob  # the very value token_logprobs holds
    return top


def logprobs_json(tokens: list[TokenEvent], offset: int, finish: FinishInfo | None,
                  echo: bool) -> dict[str, Any]:
    """The prompt's tokens first where echoed, then the generated ``tokens``."""
    infos = [*(finish.prefill if echo and finish else ()), *(e.token for e in tokens)]
    offsets, at = [], offset
    for info in infos:
        offsets.append(at)
        at += len(info.text)
    return {"tokens": [t.text for t in infos],
            "token_logprobs": [t.logprob for t in infos],
            "top_logprobs": [top_json(t) for t in infos],
            "text_offset": offsets}


def prompt_texts(body: CompletionRequest, runtime: Runtime) -> list[str]:
    """What ``echo`` sends back of each prompt: a text as given, token ids decoded with
    their special tokens (as /detokenize and vLLM do)."""
    tokenizer = runtime.artifact.codec.tokenizer
    return [p if isinstance(p, str) else str(tokenizer.decode(p, skip_special_tokens=False))
            for p in body.prompts]


@router.post("/completions", summary="OpenAI completions, plain or streamed",
             responses={**json_or_sse(Completion, "A completion, or its chunks when streamed"),
                        **OPENAI_ERRORS})
async def completions(body: CompletionRequest, request: Request,
                      runtime: ReadyRuntime) -> Any:
    requests = completion_requests(body, runtime)
    assert runtime.engine is not None
    handles = runtime.engine.submit(requests)
    completion_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    texts = prompt_texts(body, runtime)
    prompts = [texts[i // body.n] for i in range(len(requests))]
    if body.stream:
        return StreamingResponse(
            stream(body, runtime, handles, prompts, completion_id, created),
            media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    results = await collect(handles, request)
    choices = []
    for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        # max_tokens 0: the one token run for the prompt's logprobs is left out
        tokens = [] if body.scores_only else result.tokens
        text = "" if body.scores_only else final_text(result.finish)
        prefix = prompt if body.echo else ""
        choices.append({
            "index": i, "text": prefix + text,
            "logprobs": logprobs_json(tokens, 0, result.finish, body.echo)
            if body.logprobs is not None else None,
            "finish_reason": "length" if body.scores_only else finish_reason(result.finish)})
    prompt_tokens = sum(len(r.prompt_ids) for r in requests[::body.n])
    completion_tokens = 0 if body.scores_only else sum(
        r.finish.generated_tokens for r in results)
    return JSONResponse({"id": completion_id, "object": "text_completion", "created": created,
                         "model": served_name(requests, runtime), "choices": choices,
                         "usage": usage(prompt_tokens, completion_tokens)})


async def stream(body: CompletionRequest, runtime: Runtime, handles: list[Any],
                 prompts: list[str], completion_id: str, created: int) -> AsyncIterator[bytes]:
    model = served_name([h.request for h in handles], runtime)
    def chunk(index: int, text: str, lp: dict[str, Any] | None, reason: str | None) -> bytes:
        return sse({"id": completion_id, "object": "text_completion", "created": created,
                    "model": model,
                    "choices": [{"index": index, "text": text, "logprobs": lp,
                                 "finish_reason": reason}]})

    completion_tokens = 0
    try:
        if body.scores_only:  # one chunk a choice: its prompt, scored once its token is in
            async for piece in stream_pieces(handles, ()):
                if piece.event.finish is not None:
                    yield chunk(piece.choice, prompts[piece.choice],
                                logprobs_json([], 0, piece.event.finish, True)
                                if body.logprobs is not None else None, "length")
        else:
            if body.echo:
                for i, prompt in enumerate(prompts):
                    yield chunk(i, prompt, None, None)
            async for piece in stream_pieces(handles, body.stop_sequences):
                if piece.event.finish is not None:
                    completion_tokens += piece.event.finish.generated_tokens
                yield chunk(piece.choice, piece.text,
                            logprobs_json([piece.event], piece.offset, None, False)
                            if body.logprobs is not None else None, piece.reason)
        if body.include_usage:
            prompt_tokens = sum(len(h.request.prompt_ids) for h in handles[::body.n])
            yield sse({"id": completion_id, "object": "text_completion", "created": created,
                       "model": model, "choices": [],
                       "usage": usage(prompt_tokens, completion_tokens)})
        yield sse("[DONE]")
    except ApiError as exc:
        yield error_chunk(exc)
