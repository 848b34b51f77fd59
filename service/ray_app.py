"""attnserve on Ray Serve: the same HTTP API from N engine replicas placed across a cluster's
nodes, autoscaled on ongoing requests, LoRA adapters multiplexed across replicas.

Each replica is today's server, unchanged: the FastAPI app of ``service.http.app`` built
inside a Serve deployment (``@serve.ingress`` with an app builder), so its lifespan loads the
engine, and its routes (TGI, OpenAI, /attention, /metrics of that replica), streaming and
drain on shutdown are the server's own. Serve's proxy on every node takes HTTP and picks a
replica; a request that carries the header ``serve_multiplexed_model_id: NAME`` goes to a
replica that already has adapter NAME loaded where one has (Serve's model multiplexing).
The replica loads it on its first such request, from ``lora_dir/NAME`` (confined there, as
the run-time load route is), keeps at most ``max_adapters_per_replica``, and unloads the
least recently used, waiting for its requests in flight. The body still names the adapter
as it would on one server (OpenAI ``model``, TGI ``parameters.adapter_id``).

Run (deploy/ray/serve.yaml; ``pip install .[ray]``)::

    serve run deploy/ray/serve.yaml            # or: serve deploy, on a running cluster

``build_app`` is the application builder that file names; its ``args`` are
:class:`RayServeArgs`. Each response names the replica and node that served it
(``x-attnserve-replica``, ``x-attnserve-node``).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve import Application

log = logging.getLogger("attnserve.ray")

REPLICA_HEADER = "x-attnserve-replica"
NODE_HEADER = "x-attnserve-node"


class RayServeArgs(BaseModel):
    """The application's arguments (the ``args`` of deploy/ray/serve.yaml)."""

    model_config = ConfigDict(extra="forbid")

    serve: dict[str, Any] = Field(
        description="the replica's server settings: any field of service/settings.py's "
                    "Settings (model, max_loras, lora_dir, ...), as for `attnserve serve`")
    max_adapters_per_replica: int = Field(
        4, ge=1, description="adapters a replica keeps loaded for multiplexed requests "
                             "(least recently used unloaded first)")
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(
        16.0, gt=0, description="ongoing requests per replica autoscaling aims at")
    upscale_delay_s: float = Field(30.0, ge=0, description="load held this long adds replicas")
    downscale_delay_s: float = Field(600.0, ge=0,
                                     description="idleness held this long removes replicas")
    max_ongoing_requests: int = Field(
        64, ge=1, description="requests a replica takes at once before the proxy queues")
    max_replicas_per_node: int | None = Field(
        None, ge=1, description="spread replicas over nodes (None: no limit)")
    num_cpus: float = Field(1.0, gt=0, description="CPUs reserved per replica")


class _LoadedAdapter:
    """One adapter this replica loaded for multiplexed requests. Serve calls ``__del__``
    (in a worker thread) when it evicts it, least recently used: it stops serving it once
    its requests in flight finish. Once only: the garbage collector calls it again."""

    def __init__(self, replica: EngineReplica, name: str) -> None:
        self.replica, self.name, self.unloaded = replica, name, False

    def __del__(self) -> None:
        if not self.unloaded:
            self.unloaded = True
            self.replica.unload_adapter(self.name)


@serve.ingress()
class EngineReplica:
    """One engine: today's FastAPI app, built on the replica (``__serve_build_asgi_app__``)."""

    def __init__(self, serve_options: dict[str, Any], max_adapters: int) -> None:
        from service.settings import Settings

        self.settings = Settings(**serve_options)
        self.http_app: Any = None

        async def load(name: str) -> _LoadedAdapter | None:  # a function: Serve keeps its
            return await self._load_adapter(name)  # multiplexer on it, not on a method

        self.multiplexed_load = serve.multiplexed(max_num_models_per_replica=max_adapters)(
            load)

    def __serve_build_asgi_app__(self) -> Any:
        from fastapi import Request
        from fastapi.responses import JSONResponse

        from service.http.app import create_app

        app = create_app(self.settings)
        context = serve.get_replica_context()
        import ray

        replica, node = context.replica_id.unique_id, ray.get_runtime_context().get_node_id()

        @app.middleware("http")
        async def multiplexed(request: Request, call_next: Any) -> Any:
            name = serve.get_multiplexed_model_id()
            if name:
                try:
                    await self.multiplexed_load(name)
                except (LookupError, ValueError, OSError) as exc:
                    return JSONResponse(
                        {"error": f"adapter {name!r} could not be loaded: {exc}",
                         "error_type": "not_found"}, status_code=404,
                        headers={REPLICA_HEADER: replica, NODE_HEADER: node})
            response = await call_next(request)
            response.headers[REPLICA_HEADER] = replica
            response.headers[NODE_HEADER] = node
            return response

        self.http_app = app
        return app

    def _state(self) -> Any:
        """The server's Runtime (None before the app's lifespan has made it)."""
        return None if self.http_app is None else getattr(self.http_app.state, "runtime", None)

    @property
    def _runtime(self) -> Any:
        runtime = self._state()
        if runtime is None or not runtime.ready or runtime.engine is None:
            raise RuntimeError("the engine is not loaded yet")
        return runtime

    async def _load_adapter(self, name: str) -> _LoadedAdapter | None:
        """Serve ``name`` from ``lora_dir/name`` unless it is served already (a
        --lora-modules adapter: never unloaded by multiplexing)."""
        from service.engine.adapters import confined

        runtime = self._runtime
        adapters = runtime.engine.adapters
        if adapters is None or runtime.settings.lora_dir is None:
            raise LookupError("this deployment serves no run-time adapters (serve.runtime_lora "
                              "and serve.lora_dir)")
        if name in adapters.names():
            return None
        root = Path(runtime.settings.lora_dir)
        weights = await asyncio.to_thread(
            lambda: adapters.read(confined(root / name, root), name))
        runtime.add_adapter(weights)
        self.http_app.openapi_schema = None  # the document's model names change
        log.info("adapter %s loaded for multiplexed requests", name)
        return _LoadedAdapter(self, name)

    def unload_adapter(self, name: str) -> None:
        """Stop serving ``name`` (blocking: waits up to drain_timeout for its requests)."""
        self._runtime.remove_adapter(name)
        self.http_app.openapi_schema = None
        log.info("adapter %s unloaded (least recently used)", name)

    def check_health(self) -> None:
        """Serve restarts a replica whose engine failed to load (a replica still loading
        is healthy: its /ready and model routes answer 503 until it is done)."""
        runtime = self._state()
        if runtime is not None and runtime.load_error is not None:
            raise RuntimeError(f"the model failed to load: {runtime.load_error}")


def build_app(args: dict[str, Any]) -> Application:
    """The Serve application of deploy/ray/serve.yaml: :class:`EngineReplica` with the
    autoscaling and placement of ``args`` (:class:`RayServeArgs`)."""
    options = RayServeArgs.model_validate(args)
    placement: dict[str, Any] = {}
    if options.max_replicas_per_node is not None:
        placement["max_replicas_per_node"] = options.max_replicas_per_node
    deployment = serve.deployment(
        name="attnserve",
        autoscaling_config={"min_replicas": options.min_replicas,
                            "max_replicas": options.max_replicas,
                            "target_ongoing_requests": options.target_ongoing_requests,
                            "upscale_delay_s": options.upscale_delay_s,
                            "downscale_delay_s": options.downscale_delay_s},
        max_ongoing_requests=options.max_ongoing_requests,
        ray_actor_options={"num_cpus": options.num_cpus},
        health_check_period_s=10, graceful_shutdown_timeout_s=30, **placement)(EngineReplica)
    return deployment.bind(options.serve, options.max_adapters_per_replica)
