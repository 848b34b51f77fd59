"""OpenAI-compatible completions: POST /v1/completions, GET /v1/models (what vLLM serves).

OpenAI leaves a matched stop sequence out of the text. While streaming, the last
``len(longest stop) - 1`` characters are held back until they cannot begin a stop
sequence, so no part of one is ever sent.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from service.deps import ReadyRuntime, RuntimeDep, require_api_key
from service.engine.request import FinishInfo, GenerationRequest, SamplingParams, TokenEvent
from service.errors import ApiError
from service.routes.relay import collect, merge, sse
from service.runtime import Runtime
from service.schemas import CompletionRequest

router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[Depends(require_api_key)])


def model_card(runtime: Runtime) -> dict[str, Any]:
    return {"id": runtime.artifact.name, "object": "model", "created": int(runtime.started_at),
            "owned_by": "attnserve", "max_model_len": runtime.artifact.limits.max_total_tokens}


@router.get("/models", summary="The one model this server serves")
async def list_models(runtime: RuntimeDep) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(runtime)]}


@router.get("/models/{model_id}")
async def get_model(model_id: str, runtime: RuntimeDep) -> dict[str, Any]:
    if model_id != runtime.artifact.name:
        raise ApiError(404, f"model {model_id!r} not found", "not_found", param="model",
                       code="model_not_found")
    return model_card(runtime)


def build_requests(body: CompletionRequest, runtime: Runtime) -> list[GenerationRequest]:
    if body.model != runtime.artifact.name:
        raise ApiError(404, f"model {body.model!r} not found; this server serves "
                            f"{runtime.artifact.name!r}", "not_found", param="model",
                       code="model_not_found")
    validator = runtime.validator
    validator.check_count(len(body.prompts) * body.n, "n" if body.n > 1 else "prompt")
    sampling = body.to_sampling_params()
    requests = []
    for i, prompt in enumerate(body.prompts):
        field = "prompt" if isinstance(body.prompt, str) else f"prompt.{i}"
        ids = validator.tokenize(prompt, field)
        for j in range(body.n):
            requests.append(validator.build(
                ids, choice_sampling(sampling, j), body.max_tokens, body.stop_sequences,
                "max_tokens", prompt_logprobs=body.echo and body.logprobs is not None))
    return requests


def choice_sampling(sampling: SamplingParams, choice: int) -> SamplingParams:
    """The n choices of a seeded request use seeds seed, seed+1, ...: reproducible, yet
    not n copies of one sample."""
    if sampling.seed is None or choice == 0:
        return sampling
    return replace(sampling, seed=(sampling.seed + choice) % 2**63)


def final_text(finish: FinishInfo) -> str:
    if finish.stop_offset is not None:
        return finish.generated_text[:finish.stop_offset]
    return finish.generated_text


def finish_reason(finish: FinishInfo) -> str:
    return "length" if finish.reason == "length" else "stop"


def logprobs_json(tokens: list[TokenEvent], offset: int, finish: FinishInfo | None,
                  echo: bool) -> dict[str, Any]:
    infos = [*(finish.prefill if echo and finish else ()), *(e.token for e in tokens)]
    offsets, at = [], offset
    for info in infos:
        offsets.append(at)
        at += len(info.text)
    return {"tokens": [t.text for t in infos],
            "token_logprobs": [t.logprob for t in infos],
            "top_logprobs": [{text: lp for _, text, lp in t.top} or None for t in infos],
            "text_offset": offsets}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@router.post("/completions", summary="OpenAI completions, plain or streamed")
async def completions(body: CompletionRequest, request: Request,
                      runtime: ReadyRuntime) -> Any:
    requests = build_requests(body, runtime)
    assert runtime.scheduler is not None
    handles = runtime.scheduler.submit(requests)
    completion_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    prompts = [body.prompts[i // body.n] for i in range(len(requests))]
    if body.stream:
        return StreamingResponse(
            stream(body, runtime, handles, prompts, completion_id, created),
            media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    results = await collect(handles, request)
    choices = []
    for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        text = final_text(result.finish)
        prefix = prompt if body.echo else ""
        choices.append({
            "index": i, "text": prefix + text,
            "logprobs": logprobs_json(result.tokens, 0, result.finish, body.echo)
            if body.logprobs is not None else None,
            "finish_reason": finish_reason(result.finish)})
    prompt_tokens = sum(len(r.prompt_ids) for r in requests[::body.n])
    completion_tokens = sum(r.finish.generated_tokens for r in results)
    return JSONResponse({"id": completion_id, "object": "text_completion", "created": created,
                         "model": runtime.artifact.name, "choices": choices,
                         "usage": usage(prompt_tokens, completion_tokens)})


async def stream(body: CompletionRequest, runtime: Runtime, handles: list[Any],
                 prompts: list[str], completion_id: str, created: int) -> AsyncIterator[bytes]:
    hold = max((len(s) for s in body.stop_sequences), default=1) - 1
    texts = ["" for _ in handles]  # generated so far, per choice
    sent = [0 for _ in handles]  # characters already sent, per choice

    def chunk(index: int, text: str, event: TokenEvent | None,
              reason: str | None) -> bytes:
        lp = (logprobs_json([event], sent[index], None, False)
              if event is not None and body.logprobs is not None else None)
        return sse({"id": completion_id, "object": "text_completion", "created": created,
                    "model": runtime.artifact.name,
                    "choices": [{"index": index, "text": text, "logprobs": lp,
                                 "finish_reason": reason}]})

    completion_tokens = 0
    try:
        if body.echo:
            for i, prompt in enumerate(prompts):
                yield chunk(i, prompt, None, None)
        async for i, event in merge(handles):
            piece = "" if event.token.special else event.token.text
            texts[i] += piece
            if event.finish is None:
                ready = len(texts[i]) - hold
                out = texts[i][sent[i]:ready] if ready > sent[i] else ""
                sent[i] += len(out)
                yield chunk(i, out, event, None)
            else:
                completion_tokens += event.finish.generated_tokens
                rest = final_text(event.finish)[sent[i]:]
                sent[i] += len(rest)
                yield chunk(i, rest, event, finish_reason(event.finish))
        if body.stream_options is not None and body.stream_options.include_usage:
            prompt_tokens = sum(len(h.request.prompt_ids) for h in handles[::body.n])
            yield sse({"id": completion_id, "object": "text_completion", "created": created,
                       "model": runtime.artifact.name, "choices": [],
                       "usage": usage(prompt_tokens, completion_tokens)})
        yield sse("[DONE]")
    except ApiError as exc:
        yield sse({"error": {"message": exc.message, "type": exc.error_type,
                             "code": exc.code, "param": None}})
