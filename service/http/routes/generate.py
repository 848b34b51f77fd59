"""TGI-compatible generation: POST /generate and POST /generate_stream (SSE); the requests
are built in service/http/tgi_requests.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from service.engine.request import FinishInfo, TokenInfo
from service.http.deps import ReadyRuntime, require_api_key
from service.http.errors import ApiError
from service.http.relay import Completed, collect, merge, sse
from service.http.responses import SSE_NOTE, GenerateResponse, sse_content, tgi_errors
from service.http.schemas import CompatRequest, GenerateParameters, GenerateRequest, StreamRequest
from service.http.tgi_requests import generate_requests, stream_request

router = APIRouter(tags=["generate"], dependencies=[Depends(require_api_key)])
TGI_ERRORS = tgi_errors(401, 404, 413, 422, 424, 429, 503)


def token_json(token: TokenInfo, with_special: bool = True) -> dict[str, Any]:
    data: dict[str, Any] = {"id": token.id, "text": token.text, "logprob": token.logprob}
    if with_special:
        data["special"] = token.special
    return data


def top_tokens_json(token: TokenInfo, special: frozenset[int]) -> list[dict[str, Any]]:
    """TGI's top_tokens of one position: the most likely tokens with their logprobs."""
    return [{"id": i, "text": text, "logprob": lp, "special": i in special}
            for i, text, lp in token.top]


def details_json(result: Completed, params: GenerateParameters,
                 special: frozenset[int]) -> dict[str, Any]:
    finish = result.finish
    details: dict[str, Any] = {
        "finish_reason": finish.reason,
        "generated_tokens": finish.generated_tokens,
        "seed": finish.seed,
        "prefill": [token_json(t, False) for t in finish.prefill]
        if params.decoder_input_details else [],
        "tokens": [token_json(e.token) for e in result.tokens],
    }
    if params.top_n_tokens:
        details["top_tokens"] = [top_tokens_json(e.token, special) for e in result.tokens]
    return details


def output_text(prompt: str, finish: FinishInfo, params: GenerateParameters) -> str:
    return prompt + finish.generated_text if params.return_full_text else finish.generated_text


def timing_headers(results: list[Completed]) -> dict[str, str]:
    """TGI's headers, in milliseconds; for a list of inputs, the slowest of them."""
    queue = max(r.finish.queue_time for r in results)
    inference = max(r.finish.inference_time for r in results)
    generated = sum(r.finish.generated_tokens for r in results)
    return {
        "x-queue-time": str(round(queue * 1000)),
        "x-inference-time": str(round(inference * 1000)),
        "x-time-per-token": str(round(inference * 1000 / max(generated, 1))),
        "x-prompt-tokens": str(sum(r.prompt_tokens for r in results)),
        "x-generated-tokens": str(generated),
    }


@router.post("/generate", summary="Generate text (TGI); a list of inputs gives a list back",
             responses={200: {"model": GenerateResponse | list[GenerateResponse]},
                        **TGI_ERRORS})
async def generate(body: GenerateRequest, request: Request, runtime: ReadyRuntime) -> JSONResponse:
    params = body.parameters
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    requests = generate_requests(body, runtime)
    assert runtime.engine is not None
    results = await collect(runtime.engine.submit(requests), request)
    outputs = []
    for text, result in zip(texts, results, strict=True):
        item: dict[str, Any] = {"generated_text": output_text(text, result.finish, params)}
        if params.details or params.decoder_input_details:
            item["details"] = details_json(result, params, runtime.artifact.codec.special_ids)
        outputs.append(item)
    content: Any = outputs[0] if isinstance(body.inputs, str) else outputs
    return JSONResponse(content, headers=timing_headers(results))


@router.post("/generate_stream", summary="Generate text token by token as Server-Sent Events",
             response_class=StreamingResponse,
             responses={200: {"description": SSE_NOTE + " (schema: StreamResponse)",
                              "content": sse_content("events of StreamResponse")},
                        **TGI_ERRORS})
async def generate_stream(body: StreamRequest, runtime: ReadyRuntime) -> StreamingResponse:
    params = body.parameters
    request = stream_request(body, runtime)
    special = runtime.artifact.codec.special_ids
    assert runtime.engine is not None
    (handle,) = runtime.engine.submit([request])

    async def events() -> AsyncIterator[bytes]:
        try:
            async for _, event in merge([handle]):
                payload: dict[str, Any] = {
                    "index": event.index + 1, "token": token_json(event.token),
                    "top_tokens": top_tokens_json(event.token, special)
                    if params.top_n_tokens else None,
                    "generated_text": None, "details": None}
                if event.finish is not None:
                    payload["generated_text"] = output_text(body.inputs, event.finish, params)
                    payload["details"] = {
                        "finish_reason": event.finish.reason,
                        "generated_tokens": event.finish.generated_tokens,
                        "seed": event.finish.seed,
                        "input_length": len(request.prompt_ids)}
                yield sse(payload)
        except ApiError as exc:
            yield sse({"error": exc.message, "error_type": exc.error_type})

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                      "x-prompt-tokens": str(len(request.prompt_ids))})


@router.post("/", summary="TGI's compatibility route: /generate, or /generate_stream when "
                          "`stream` is true",
             responses={200: {"model": list[GenerateResponse],
                              "content": sse_content("events of StreamResponse")},
                        **TGI_ERRORS})
async def compat_generate(body: CompatRequest, request: Request, runtime: ReadyRuntime) -> Any:
    if body.stream:
        return await generate_stream(
            StreamRequest(inputs=body.inputs, parameters=body.parameters, stream=True), runtime)
    # TGI answers a list of one here (its client reads element 0)
    return await generate(GenerateRequest(inputs=[body.inputs], parameters=body.parameters),
                          request, runtime)
