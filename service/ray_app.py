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
least recently used, waiting for its requests in flight.

Clients name the adapter as they would on one server, in the body (OpenAI ``model``, TGI
``parameters.adapter_id``), which Serve's proxy does not read. So by default
(``adapter_routing: body``) the application's ingress is :class:`AdapterRouter`, as
``ray.serve.llm``'s router is: it reads the body, and passes the request on to the replicas
through a handle carrying the adapter as the multiplexed model id, the replica's response
(SSE included) streamed back. With ``adapter_routing: header`` the replicas are the ingress
themselves (one hop fewer) and a client or gateway sets ``serve_multiplexed_model_id``.

Serve's proxy answers ``/metrics`` from whichever replica it picks. So each replica, once
its engine is loaded, also serves its own registry on a port of its node
(``replica_metrics_port``) and tells the router, whose ``/metrics/replicas`` lists those
endpoints in Prometheus' HTTP service-discovery format (``http_sd_configs``), with
``replica`` and ``node`` labels: one scrape target a replica.

Run (deploy/ray/serve.yaml; ``pip install .[ray]``)::

    serve run deploy/ray/serve.yaml            # or: serve deploy, on a running cluster

``build_app`` is the application builder that file names; its ``args`` are
:class:`RayServeArgs`. Each response names the replica and node that served it
(``x-attnserve-replica``, ``x-attnserve-node``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

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
    replica_metrics_port: int | None = Field(
        0, ge=0, le=65535, description="each replica's own /metrics on this port of its "
                                       "node (0: any free one; null: none), listed by the "
                                       "router's /metrics/replicas for Prometheus")
    router_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources the router's actor asks for "
                                          "(adapter_routing: body), to keep it off the "
                                          "engines' nodes: e.g. {ingress: 0.01} where only "
                                          "the head node (Serve's proxy) declares ingress")
    adapter_routing: Literal["body", "header"] = Field(
        "body", description="body: an ingress reads the adapter a request names (OpenAI "
                            "model, TGI parameters.adapter_id) and routes it to a replica "
                            "holding it; header: the replicas are the ingress and route by "
                            "the serve_multiplexed_model_id header alone")


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

    def __init__(self, serve_options: dict[str, Any], max_adapters: int,
                 metrics_port: int | None = None, routed: bool = False) -> None:
        from service.settings import Settings

        self.settings = Settings(**serve_options)
        self.http_app: Any = None
        self.metrics_port = metrics_port
        self.routed = routed  # behind AdapterRouter, which lists the metrics endpoints
        self.metrics_address: str | None = None  # host:port of this replica's own /metrics

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

    def model_name(self) -> str:
        """The base model's name (OpenAI ``model`` naming no adapter)."""
        return str(self._runtime.artifact.name)

    async def forward(self, method: str, path: str, query: bytes,
                      headers: list[tuple[bytes, bytes]], body: bytes
                      ) -> AsyncIterator[dict[str, Any] | bytes]:
        """One HTTP request run through this replica's app, as :class:`AdapterRouter`
        passes it on: first ``{"status", "headers"}``, then the body's pieces as the app
        sends them (an SSE stream event by event). The multiplexed model id of the handle
        call is the app's as it is for the proxy's requests."""
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
                 "query_string": query, "root_path": "", "headers": headers,
                 "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
        sent: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        gone = asyncio.Event()  # the router's client left: the app sees a disconnect
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await sent.put(message)

        async def run() -> None:
            try:
                await self.http_app(scope, receive, send)
            finally:
                await sent.put(None)

        task = asyncio.create_task(run())
        try:
            while (message := await sent.get()) is not None:
                if message["type"] == "http.response.start":
                    yield {"status": message["status"],
                           "headers": [(k.decode("latin-1"), v.decode("latin-1"))
                                       for k, v in message.get("headers", [])]}
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body"):
                        break
            await task
        finally:
            gone.set()
            if not task.done():
                task.cancel()

    def check_health(self) -> None:
        """Serve restarts a replica whose engine failed to load (a replica still loading
        is healthy: its /ready and model routes answer 503 until it is done). A loaded one
        (re)announces its own /metrics endpoint to the router at every check."""
        runtime = self._state()
        if runtime is not None and runtime.load_error is not None:
            raise RuntimeError(f"the model failed to load: {runtime.load_error}")
        if runtime is not None and runtime.ready and self.metrics_port is not None:
            self._announce_metrics(runtime)

    def _announce_metrics(self, runtime: Any) -> None:
        """Serve this replica's registry on its node (once) and tell the router where."""
        import ray
        from prometheus_client import start_http_server

        context = serve.get_replica_context()
        if self.metrics_address is None:
            host = ray.util.get_node_ip_address()
            server, _ = start_http_server(self.metrics_port or 0, addr=host,
                                          registry=runtime.metrics.registry)
            self.metrics_address = f"{host}:{server.server_port}"
            log.info("replica metrics on http://%s/metrics", self.metrics_address)
        if not self.routed:
            return
        router = serve.get_deployment_handle(ROUTER_NAME, context.app_name)
        router.add_metrics_target.remote(context.replica_id.unique_id,
                                         ray.get_runtime_context().get_node_id(),
                                         self.metrics_address)


MULTIPLEXED_HEADER = "serve_multiplexed_model_id"  # Serve's own, honoured as by its proxy
# The routes whose JSON body names an adapter, and where: OpenAI's model, TGI's adapter_id.
OPENAI_ROUTES = ("/v1/completions", "/v1/chat/completions")
TGI_ROUTES = ("/generate", "/generate_stream", "/")


def adapter_named(path: str, body: bytes, base_name: str) -> str:
    """The adapter a request's body names ("" for the base model, or a body that is not a
    request's JSON: the replica's route then answers it as on one server)."""
    if path not in OPENAI_ROUTES and path not in TGI_ROUTES:
        return ""
    try:
        request = json.loads(body) if body else None
    except ValueError:
        return ""
    if not isinstance(request, dict):
        return ""
    if path in OPENAI_ROUTES:
        model = request.get("model")
        return model if isinstance(model, str) and model and model != base_name else ""
    parameters = request.get("parameters")
    adapter = parameters.get("adapter_id") if isinstance(parameters, dict) else None
    return adapter if isinstance(adapter, str) else ""


ROUTER_NAME = "attnserve-router"
METRICS_TARGETS_PATH = "/metrics/replicas"
# A replica announces its metrics endpoint at every health check (10 s): one not heard of
# for three periods is gone (stopped, or its node lost).
METRICS_TARGET_TTL_S = 30.0


class AdapterRouter:
    """The ingress with ``adapter_routing: body``: each request goes to the replicas through
    a handle whose multiplexed model id is the adapter its body names, so Serve sends it to
    a replica holding that adapter (and one loads it where none does). Also keeps the
    replicas' own metrics endpoints for Prometheus (``/metrics/replicas``)."""

    def __init__(self, replicas: Any) -> None:
        self.replicas = replicas
        self.base_name: str | None = None
        self.metrics_targets: dict[str, tuple[str, str, float]] = {}  # replica → node, addr, seen

    def add_metrics_target(self, replica: str, node: str, address: str) -> None:
        self.metrics_targets[replica] = (node, address, time.monotonic())

    def metrics_service_discovery(self) -> list[dict[str, Any]]:
        """The live replicas' /metrics endpoints, as Prometheus' http_sd_configs reads."""
        now = time.monotonic()
        return [{"targets": [address], "labels": {"replica": replica, "node": node}}
                for replica, (node, address, seen) in sorted(self.metrics_targets.items())
                if now - seen < METRICS_TARGET_TTL_S]

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, StreamingResponse

        path = request.url.path
        if path == METRICS_TARGETS_PATH and request.method == "GET":
            return JSONResponse(self.metrics_service_discovery())
        body = await request.body()
        name = request.headers.get(MULTIPLEXED_HEADER, "")
        if not name and (path in OPENAI_ROUTES or path in TGI_ROUTES):
            if self.base_name is None:  # asked once, of a replica with its model loaded
                self.base_name = await self.replicas.model_name.remote()
            name = adapter_named(path, body, self.base_name)
        handle = self.replicas.options(stream=True, multiplexed_model_id=name)
        pieces = handle.forward.remote(request.method, path, request.url.query.encode(),
                                       request.headers.raw, body)
        start = await pieces.__anext__()

        async def rest() -> AsyncIterator[bytes]:
            async for piece in pieces:
                yield piece

        headers = dict(start["headers"])
        headers.pop("content-length", None)  # the body is streamed on
        return StreamingResponse(rest(), status_code=start["status"], headers=headers,
                                 media_type=headers.get("content-type"))


def build_app(args: dict[str, Any]) -> Application:
    """The Serve application of deploy/ray/serve.yaml: :class:`EngineReplica` with the
    autoscaling and placement of ``args`` (:class:`RayServeArgs`), behind
    :class:`AdapterRouter` unless ``adapter_routing`` is ``header``."""
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
    routed = options.adapter_routing == "body"
    replicas = deployment.bind(options.serve, options.max_adapters_per_replica,
                               options.replica_metrics_port, routed)
    if not routed:
        return replicas
    router = serve.deployment(name=ROUTER_NAME,
                              ray_actor_options={"num_cpus": 0,
                                                 "resources": options.router_resources},
                              max_ongoing_requests=10_000)(AdapterRouter)
    return router.bind(replicas)
