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

from service.engine.grammar import Grammar
from service.engine.request import FinishInfo, GenerationRequest, SamplingParams, TokenEvent
from service.http.deps import ReadyRuntime, RuntimeDep, require_api_key
from service.http.errors import ApiError
from service.http.openai_schemas import CompletionRequest, JsonSchemaFormat, OpenAISampling
from service.http.responses import Completion, ModelCard, ModelList, json_or_sse, openai_errors
from service.http.routes.relay import collect, merge, sse
from service.http.runtime import Runtime
from service.http.schemas import SEED_BOUND
from service.http.validation import Validator

router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[Depends(require_api_key)])
OPENAI_ERRORS = openai_errors(401, 404, 413, 422, 424, 429, 503)


def model_card(runtime: Runtime) -> dict[str, Any]:
    return {"id": runtime.artifact.name, "object": "model", "created": int(runtime.started_at),
            "owned_by": "attnserve", "max_model_len": runtime.artifact.limits.max_total_tokens}


@router.get("/models", summary="The one model this server serves",
            responses={200: {"model": ModelList}, **openai_errors(401, 503)})
async def list_models(runtime: RuntimeDep) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(runtime)]}


@router.get("/models/{model_id}", summary="The model card, if the name is the served one",
            responses={200: {"model": ModelCard}, **openai_errors(401, 404, 503)})
async def get_model(model_id: str, runtime: RuntimeDep) -> dict[str, Any]:
    if model_id != runtime.artifact.name:
        raise ApiError(404, f"model {model_id!r} not found", "not_found", param="model",
                       code="model_not_found")
    return model_card(runtime)


def check_model(model: str | None, runtime: Runtime) -> None:
    if model is not None and model != runtime.artifact.name:
        raise ApiError(404, f"model {model!r} not found; this server serves "
                            f"{runtime.artifact.name!r}", "not_found", param="model",
                       code="model_not_found")


def response_constraint(body: OpenAISampling, validator: Validator) -> Grammar | None:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return validator.grammar("json_schema", {"type": "object"}, "response_format")
    assert isinstance(fmt, JsonSchemaFormat)
    return validator.grammar("json_schema", fmt.json_schema.json_schema,
                             "response_format.json_schema.schema")


def sampling_params(body: OpenAISampling, validator: Validator, top_n: int) -> SamplingParams:
    bias = []
    for key, value in (body.logit_bias or {}).items():
        validator.check_token_id(int(key), f"logit_bias.{key}")
        bias.append((int(key), value))
    return SamplingParams(
        do_sample=body.temperature > 0,
        temperature=body.temperature if body.temperature > 0 else 1.0,
        top_k=max(body.top_k, 0), top_p=body.top_p, min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        logit_bias=tuple(bias), seed=body.seed, top_n_logprobs=top_n,
        constraint=response_constraint(body, validator))


def build_requests(body: OpenAISampling, runtime: Runtime, prompts: list[tuple[str, list[int]]],
                   max_new_tokens: int | None, top_n: int, prompt_logprobs: bool = False,
                   max_field: str = "max_tokens", token_logprobs: bool = True
                   ) -> list[GenerationRequest]:
    """n requests per prompt; ``prompts`` are (field, token ids); ``token_logprobs``: the
    client asked for logprobs."""
    validator = runtime.validator
    validator.check_count(len(prompts) * body.n, "n" if body.n > 1 else "prompt")
    defaults = runtime.artifact.generation_defaults
    body = defaults.fill(body)
    length_given = bool({"max_tokens", "max_completion_tokens"} & body.model_fields_set)
    if defaults.max_new_tokens is not None and not length_given:
        max_new_tokens = None  # the author's length, shortened to fit like the server's own
    stop_ids = tuple(body.stop_token_ids or ())
    validator.check_token_ids(stop_ids, "stop_token_ids")
    sampling = sampling_params(body, validator, top_n)
    requests = []
    for _, ids in prompts:
        for j in range(body.n):
            requests.append(validator.build(
                ids, choice_sampling(sampling, j), max_new_tokens, body.stop_sequences,
                max_field, prompt_logprobs=prompt_logprobs, stop_token_ids=stop_ids,
                default_max_new_tokens=defaults.max_new_tokens,
                ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
                token_logprobs=token_logprobs))
    return requests


def completion_requests(body: CompletionRequest, runtime: Runtime) -> list[GenerationRequest]:
    check_model(body.model, runtime)
    prompts = []
    for i, prompt in enumerate(body.prompts):
        field = "prompt" if isinstance(body.prompt, str) else f"prompt.{i}"
        prompts.append((field, runtime.validator.tokenize(prompt, field)))
    return build_requests(body, runtime, prompts, body.max_tokens, body.top_n_logprobs,
                          prompt_logprobs=body.echo and body.logprobs is not None,
                          token_logprobs=body.logprobs is not None)


def choice_sampling(sampling: SamplingParams, choice: int) -> SamplingParams:
    """The n choices of a seeded request use seeds seed, seed+1, ...: reproducible, yet
    not n copies of one sample."""
    if sampling.seed is None or choice == 0:
        return sampling
    return replace(sampling, seed=(sampling.seed + choice) % SEED_BOUND)


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


@router.post("/completions", summary="OpenAI completions, plain or streamed",
             responses={**json_or_sse(Completion, "A completion, or its chunks when streamed"),
                        **OPENAI_ERRORS})
async def completions(body: CompletionRequest, request: Request,
                      runtime: ReadyRuntime) -> Any:
    requests = completion_requests(body, runtime)
    assert runtime.engine is not None
    handles = runtime.engine.submit(requests)
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
        if body.include_usage:
            prompt_tokens = sum(len(h.request.prompt_ids) for h in handles[::body.n])
            yield sse({"id": completion_id, "object": "text_completion", "created": created,
                       "model": runtime.artifact.name, "choices": [],
                       "usage": usage(prompt_tokens, completion_tokens)})
        yield sse("[DONE]")
    except ApiError as exc:
        yield sse({"error": {"message": exc.message, "type": exc.error_type,
                             "code": exc.code, "param": None}})
