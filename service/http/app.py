"""The FastAPI application: ``create_app`` and the lifespan that owns the engine.

Start-up order: open the artifact (manifest sha256, config, tokenizer, device) before the
server listens, then, in the background, create the ONNX Runtime sessions, run a warm-up
generation and start the engine loop. /health answers at once; /ready and the model
routes answer 503 until the warm-up is done, and again while draining at shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from service.artifact.loader import Artifact, open_artifact
from service.engine.grammar import GrammarCompiler
from service.http.errors import install_error_handlers
from service.http.metrics import Metrics
from service.http.middleware import ObservabilityMiddleware
from service.http.openapi import install as install_openapi
from service.http.runtime import Runtime, load_engine
from service.http.validation import Validator
from service.settings import Settings

log = logging.getLogger("attnserve")


def create_app(settings: Settings, artifact: Artifact | None = None,
               on_fatal: Callable[[], None] | None = None) -> FastAPI:
    """The app for ``settings``; ``on_fatal`` is called if the model fails to load."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        opened = artifact or open_artifact(settings)
        metrics = Metrics()
        config = opened.config
        # A grammar ends by emitting eos; a tokenizer without one gets no structured output.
        grammars = None if config.eos_token_id is None else GrammarCompiler(
            opened.codec.tokenizer.to_str(), config.vocab_size, config.eos_token_id)
        runtime = Runtime(settings, opened, metrics, Validator(
            opened.codec, opened.limits, config.eos_token_id,
            opened.default_max_new_tokens,
            vocab_size=config.vocab_size, extra_eos_ids=opened.extra_eos_ids,
            grammars=grammars, max_queued_requests=settings.max_queued_requests))
        app.state.runtime = runtime
        loader = asyncio.create_task(_load(runtime, on_fatal))
        try:
            yield
        finally:
            runtime.draining = True
            loader.cancel()
            if runtime.engine is not None:
                await asyncio.to_thread(runtime.engine.stop, 10.0)
            await asyncio.to_thread(runtime.attention_encoder.shutdown)
            runtime.attention_threads.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="attnserve", version=_version(), lifespan=lifespan,
                  docs_url="/docs", redoc_url=None)
    app.state.runtime = None
    install_error_handlers(app)
    app.add_middleware(ObservabilityMiddleware,
                       metrics=lambda: app.state.runtime.metrics if app.state.runtime else None,
                       max_body_bytes=settings.max_body_bytes)
    from service.http.routes import (
        attention,
        chat,
        control_vectors,
        generate,
        health,
        lora,
        openai,
        tokenize,
        viz,
    )

    for module in (health, generate, openai, chat, tokenize, attention):
        app.include_router(module.router)
    if settings.runtime_lora:  # vLLM registers them only when runtime updates are allowed
        app.include_router(lora.router)
    if settings.runtime_control_vectors:  # as for adapters: only when allowed
        app.include_router(control_vectors.router)
    viz.install(app)
    install_openapi(app)
    return app


async def _load(runtime: Runtime, on_fatal: Callable[[], None] | None) -> None:
    try:
        await asyncio.to_thread(load_engine, runtime)
        assert runtime.engine is not None
        runtime.engine.start(asyncio.get_running_loop())
        runtime.ready = True
        log.info("ready: %s on %s", runtime.artifact.name, runtime.provider)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        runtime.load_error = f"{type(exc).__name__}: {exc}"
        log.error("model failed to load: %s", runtime.load_error)
        if on_fatal is not None:
            on_fatal()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("attnserve")
    except PackageNotFoundError:
        return "0.0.0"
