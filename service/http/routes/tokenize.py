"""POST /tokenize and /detokenize, in vLLM's shapes, plus TGI's /tokenize.

One path serves both servers' clients, told apart by the body: ``{"inputs"}`` is TGI's
(a list of tokens with their character spans), ``{"prompt"}`` or ``{"messages"}`` is
vLLM's (the ids, their count and the context length). A LoRA adapter may be named
(vLLM's ``model``, TGI's ``parameters.adapter_id``): it must be served (404 otherwise),
and tokenizes as the base does (an adapter shares its tokenizer).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends

from service.http.adapters import adapter_of_id, adapter_of_model
from service.http.deps import RuntimeDep, require_api_key
from service.http.openai_requests import render_messages
from service.http.openai_schemas import ChatTokenizeRequest
from service.http.responses import DetokenizeResponse, TgiToken, TokenizeResponse, tgi_errors
from service.http.schemas import DetokenizeRequest, PromptTokenizeRequest, TgiTokenizeRequest
from service.http.validation import InputError

router = APIRouter(tags=["tokenize"], dependencies=[Depends(require_api_key)])

TokenizeBody = Annotated[TgiTokenizeRequest | PromptTokenizeRequest | ChatTokenizeRequest,
                         Body()]


@router.post("/tokenize", summary="Token ids of a prompt or a conversation (vLLM), or "
                                  "tokens with character spans (TGI, body {\"inputs\"})",
             responses={200: {"model": TokenizeResponse | list[TgiToken]},
                        **tgi_errors(401, 404, 413, 422, 503)})
async def tokenize(body: TokenizeBody, runtime: RuntimeDep) -> Any:
    tokenizer = runtime.artifact.codec.tokenizer
    if isinstance(body, TgiTokenizeRequest):
        adapter_id = (body.parameters or {}).get("adapter_id")
        if adapter_id is not None and not isinstance(adapter_id, str):
            raise InputError("parameters.adapter_id", "Input should be a valid string")
        adapter_of_id(adapter_id, runtime)
        encoding = tokenizer.encode(body.inputs, add_special_tokens=True)
        return [{"id": i, "text": body.inputs[start:stop], "start": start, "stop": stop}
                for i, (start, stop) in zip(encoding.ids, encoding.offsets, strict=True)]
    adapter_of_model(body.model, runtime)
    if isinstance(body, PromptTokenizeRequest):
        text, special = body.prompt, body.add_special_tokens
    else:
        text = render_messages(runtime, body.messages, body.add_generation_prompt,
                               body.chat_template_kwargs)
        special = body.add_special_tokens
    ids = list(tokenizer.encode(text, add_special_tokens=special).ids)
    return {"count": len(ids), "max_model_len": runtime.artifact.limits.max_total_tokens,
            "tokens": ids}


@router.post("/detokenize", summary="Text of a list of token ids (vLLM)",
             responses={200: {"model": DetokenizeResponse},
                        **tgi_errors(401, 404, 413, 422, 503)})
async def detokenize(body: DetokenizeRequest, runtime: RuntimeDep) -> dict[str, str]:
    adapter_of_model(body.model, runtime)
    runtime.validator.check_token_ids(body.tokens, "tokens")
    text = runtime.artifact.codec.tokenizer.decode(body.tokens, skip_special_tokens=False)
    return {"prompt": str(text)}
