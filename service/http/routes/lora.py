"""LoRA adapters loaded and unloaded at run time: vLLM's POST /v1/load_lora_adapter and
/v1/unload_lora_adapter, with its bodies and its plain-text answers.

Registered only with --runtime-lora (vLLM registers them only with
VLLM_ALLOW_RUNTIME_LORA_UPDATING; without, they are 404 as any unknown route), behind the
API key when the server has one. A load reads only under --lora-dir (``confined``: a path
or a symlink leading out is refused) and reads in a worker thread, off the event loop;
anything it refuses is a 400 naming why, and nothing is loaded. An unload stops new
requests for the adapter at once and waits, in a worker thread, up to drain_timeout for
those in flight: past it, 409 (the adapter takes no new requests and leaves when they
finish).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse

from service.contract.peft_adapter import AdapterError
from service.engine.adapters import AdapterSet, AdapterWeights, UnknownAdapter, confined
from service.http.deps import ReadyRuntime, require_api_key
from service.http.errors import ApiError
from service.http.responses import openai_errors
from service.http.runtime import Runtime
from service.http.schemas import LoadLoraAdapterRequest, UnloadLoraAdapterRequest

router = APIRouter(prefix="/v1", tags=["lora"], dependencies=[Depends(require_api_key)])
TEXT = {"content": {"text/plain": {"schema": {"type": "string"}}}}


def _adapters(runtime: Runtime) -> AdapterSet:
    assert runtime.engine is not None  # ReadyRuntime
    adapters = runtime.engine.adapters
    if adapters is None:  # --runtime-lora makes the engine serve adapters
        raise ApiError(404, "this server serves no LoRA adapters", "not_found")
    return adapters


def _refused(message: str, code: str, param: str = "lora_name") -> ApiError:
    return ApiError(400, message, "invalid_adapter", param=param, code=code)


def _read(adapters: AdapterSet, directory: Path, root: Path, name: str) -> AdapterWeights:
    """The adapter in ``directory``, if it lies under ``root`` and fits the model
    (blocking: reads the safetensors file)."""
    return adapters.read(confined(directory, root), name)


@router.post("/load_lora_adapter", summary="Load a LoRA adapter from under lora_dir and serve "
                                           "it by name (vLLM's route)",
             response_class=PlainTextResponse,
             responses={200: {"description": "Success: LoRA adapter 'NAME' added "
                                             "successfully.", **TEXT},
                        **openai_errors(400, 401, 413, 422, 503)})
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request,
                            runtime: ReadyRuntime) -> PlainTextResponse:
    adapters = _adapters(runtime)
    name = body.lora_name
    if name == runtime.artifact.name:
        raise _refused(f"The lora adapter '{name}' cannot be loaded: it is the served "
                       "model's name.", "adapter_exists")
    if name in adapters.names():
        raise _refused(f"The lora adapter '{name}' has already been loaded.", "adapter_exists")
    root = runtime.settings.lora_dir
    assert root is not None  # the engine refuses --runtime-lora without --lora-dir
    directory = Path(body.lora_path)
    if not directory.is_absolute():
        directory = root / directory
    try:
        weights = await asyncio.to_thread(_read, adapters, directory, root, name)
        runtime.add_adapter(weights)
    except AdapterError as exc:
        raise _refused(f"The lora adapter '{name}' was not loaded: {exc}",
                       "invalid_adapter", "lora_path") from None
    except ValueError:  # loaded by a request that raced this one
        raise _refused(f"The lora adapter '{name}' has already been loaded.",
                       "adapter_exists") from None
    request.app.openapi_schema = None  # the document's model names change
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/unload_lora_adapter", summary="Stop serving a LoRA adapter once its requests "
                                             "finish (vLLM's route)",
             response_class=PlainTextResponse,
             responses={200: {"description": "Success: LoRA adapter 'NAME' removed "
                                             "successfully.", **TEXT},
                        **openai_errors(401, 404, 409, 413, 422, 503)})
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request,
                              runtime: ReadyRuntime) -> PlainTextResponse:
    _adapters(runtime)
    name = body.lora_name
    wait = runtime.settings.drain_timeout
    try:
        done = await asyncio.to_thread(runtime.remove_adapter, name)
    except UnknownAdapter:
        raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "not_found",
                       param="lora_name", code="model_not_found",
                       openai_type="NotFoundError") from None
    request.app.openapi_schema = None
    if not done:
        raise ApiError(409, f"The lora adapter '{name}' still has requests in flight after "
                            f"{wait:g} s (drain_timeout): it takes no new requests and is "
                            "removed once they finish.", "conflict", param="lora_name",
                       code="adapter_busy")
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
