"""Control vectors loaded and unloaded at run time: POST /v1/load_control_vector and
/v1/unload_control_vector (the adapters' routes' rules, docs/api.md "Control vectors").

Registered only with --runtime-control-vectors (404 otherwise, as any unknown route),
behind the API key when the server has one. A load reads only under --control-vector-dir
(a path or a symlink leading out is refused), in a worker thread; a file that llama.cpp
would refuse or that does not fit the model is a 400 naming why, and nothing is loaded. An
unload stops new requests naming the vector at once; rows already running keep steering
with it until they finish (they hold its directions).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import Field

from service.contract.control_vector import ControlVectorError
from service.engine.control_vectors import ControlVectors, UnknownControlVector, confined_file
from service.http.deps import ReadyRuntime, require_api_key
from service.http.errors import ApiError
from service.http.responses import openai_errors
from service.http.runtime import Runtime
from service.http.schemas import NonEmptyText, Strict

router = APIRouter(prefix="/v1", tags=["control vectors"],
                   dependencies=[Depends(require_api_key)])


class LoadControlVectorRequest(Strict):
    name: NonEmptyText = Field(description="the name requests will give in control_vector")
    path: NonEmptyText = Field(description="a control-vector GGUF file under the server's "
                                           "control_vector_dir (relative: to it)")


class UnloadControlVectorRequest(Strict):
    name: NonEmptyText


def _vectors(runtime: Runtime) -> ControlVectors:
    assert runtime.engine is not None  # ReadyRuntime
    vectors = runtime.engine.control_vectors
    if vectors is None:
        raise ApiError(404, f"{runtime.engine.graph_file} applies no control vector",
                       "not_found")
    return vectors


def _read(vectors: ControlVectors, path: Path, root: Path) -> Any:
    """The file's directions, if it lies under ``root`` and fits the model (blocking)."""
    return vectors.read(confined_file(path, root))


@router.post("/load_control_vector", summary="Load a control vector from under "
                                             "control_vector_dir and serve it by name",
             responses=openai_errors(400, 401, 413, 422, 503))
async def load_control_vector(body: LoadControlVectorRequest, request: Request,
                              runtime: ReadyRuntime) -> dict[str, Any]:
    vectors = _vectors(runtime)
    if body.name in vectors.names:
        raise ApiError(400, f"control vector {body.name!r} is already loaded",
                       "invalid_control_vector", param="name", code="control_vector_exists")
    root = runtime.settings.control_vector_dir
    assert root is not None  # the settings refuse runtime_control_vectors without it
    path = Path(body.path)
    if not path.is_absolute():
        path = root / path
    try:
        table = await asyncio.to_thread(_read, vectors, path, root)
    except ControlVectorError as exc:
        raise ApiError(400, f"control vector {body.name!r} was not loaded: {exc}",
                       "invalid_control_vector", param="path",
                       code="invalid_control_vector") from None
    vectors.add(body.name, table)
    return {"name": body.name, "layers": vectors.layers_of(body.name)}


@router.post("/unload_control_vector", summary="Stop serving a control vector (running "
                                               "rows keep it until they finish)",
             responses=openai_errors(401, 404, 413, 422, 503))
async def unload_control_vector(body: UnloadControlVectorRequest,
                                runtime: ReadyRuntime) -> dict[str, Any]:
    try:
        _vectors(runtime).remove(body.name)
    except UnknownControlVector:
        raise ApiError(404, f"control vector {body.name!r} is not served by this server",
                       "not_found", param="name", code="control_vector_not_found",
                       openai_type="NotFoundError") from None
    return {"name": body.name, "unloaded": True}
