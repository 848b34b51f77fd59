"""Liveness, readiness, server information and the Prometheus exposition.

/health, /ready and /metrics never need the API key (probes and scrapers); /info does.
"""

from __future__ import annotations

import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from service.http.control_vectors import control_vector_names
from service.http.deps import RuntimeDep, require_api_key
from service.http.responses import Status, tgi_errors

router = APIRouter(tags=["health"])


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


@router.get("/health", summary="Liveness: the process is up", responses={200: {"model": Status}})
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready", summary="Readiness: 200 once the model is loaded and warmed up",
            responses={200: {"model": Status},
                       503: {"model": Status, "description": "loading, draining or failed"}})
async def ready(runtime: RuntimeDep) -> JSONResponse:
    if runtime.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    if runtime.load_error:
        return JSONResponse({"status": "failed", "error": runtime.load_error}, status_code=503)
    if not runtime.ready:
        return JSONResponse({"status": "loading"}, status_code=503)
    return JSONResponse({"status": "ready"})


@router.get("/info", summary="Model, provider, limits, versions and artifact hashes",
            dependencies=[Depends(require_api_key)], responses=tgi_errors(401, 503))
async def info(runtime: RuntimeDep) -> dict[str, Any]:
    artifact, settings = runtime.artifact, runtime.settings
    limits = artifact.limits
    max_batch_size, max_batch_tokens = runtime.batch_limits
    return {
        "model": artifact.name,
        "model_config": artifact.config.to_dict(),
        "artifact": {"path": str(artifact.path.resolve()), "manifest_sha256": artifact.sha256,
                     "files": artifact.files},
        "provider": runtime.provider,
        "decode_graph": runtime.decode_graph,
        "kernel": runtime.kernel,
        "float32_pass_tokens": runtime.float32_pass_tokens,
        "graphs": runtime.graphs,
        "requested_providers": artifact.providers,
        "device": settings.device,
        "ready": runtime.ready,
        "limits": {
            "max_input_tokens": limits.max_input_tokens,
            "max_total_tokens": limits.max_total_tokens,
            "max_new_tokens": limits.max_new_tokens,
            "max_batch_size": max_batch_size,
            "max_batch_tokens": max_batch_tokens,
            "max_queued_requests": settings.max_queued_requests,
            "max_body_bytes": settings.max_body_bytes,
        },
        "control_vectors": control_vector_names(runtime),
        "max_control_scale": settings.max_control_scale,
        "auth": settings.api_key is not None,
        "chat_template": artifact.chat_template.origin,
        "generation_defaults": artifact.generation_defaults.to_dict(),
        "versions": {
            "attnserve": _version("attnserve"), "python": platform.python_version(),
            "onnxruntime": _version("onnxruntime") or _version("onnxruntime-gpu"),
            "numpy": _version("numpy"), "tokenizers": _version("tokenizers"),
            "fastapi": _version("fastapi"), "uvicorn": _version("uvicorn"),
        },
        "torch_imported": "torch" in sys.modules,
    }


@router.get("/metrics", summary="Prometheus exposition", response_class=PlainTextResponse,
            responses={200: {"description": "Prometheus text format 0.0.4",
                             "content": {"text/plain": {"schema": {"type": "string"}}}},
                       **tgi_errors(503)})
async def metrics(runtime: RuntimeDep) -> Response:
    body, content_type = runtime.metrics.render()
    return Response(body, media_type=content_type)
