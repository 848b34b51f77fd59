"""Running the app under uvicorn with a graceful drain on SIGTERM, exiting 0.

On SIGTERM (or Ctrl-C) the server stops accepting connections, /ready turns 503, the
requests in flight run to completion for up to ``drain_timeout`` seconds, and then the
engine stops. Stock uvicorn re-raises the signal after its shutdown, which would end the
process with 143; this subclass returns normally instead, so a drained exit is 0. If the
model fails to load in the background, the server stops and the exit code is 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import socket
import threading
from collections.abc import Iterator
from types import FrameType

import uvicorn

from service.artifact.loader import Artifact
from service.http import request_id
from service.http.app import create_app
from service.settings import Settings

HANDLED = (signal.SIGINT, signal.SIGTERM)
ABORT_GRACE_S = 2.0  # after the drain timeout: time for failed requests to send their error


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain_timeout: float) -> None:
        super().__init__(config)
        self.exit_code = 0
        self.drain_timeout = drain_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        abort = asyncio.get_running_loop().call_later(self.drain_timeout, self.abort_in_flight)
        try:
            await super().shutdown(sockets)
        finally:
            abort.cancel()

    def abort_in_flight(self) -> None:
        """Drain timeout reached: the engine fails what is left, with a proper error."""
        runtime = getattr(self.config.app.state, "runtime", None)  # type: ignore[union-attr]
        if runtime is not None and runtime.engine is not None:
            logging.getLogger("attnserve").warning(
                "drain timeout of %ss reached: failing the requests still in flight",
                self.drain_timeout)
            runtime.engine.stop(0)  # non-blocking: flags the loop, which fails the rest

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        runtime = getattr(self.config.app.state, "runtime", None)  # type: ignore[union-attr]
        if runtime is not None:
            runtime.draining = True
        logging.getLogger("attnserve").info(
            "signal %s: draining in-flight requests (up to %ss)", signal.Signals(sig).name,
            self.drain_timeout)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def fail(self) -> None:
        self.exit_code = 1
        self.should_exit = True


def serve(settings: Settings, artifact: Artifact) -> int:
    """Serve until a signal drains the server; return the process exit code."""
    request_id.install(settings.log_level)
    holder: list[DrainingServer] = []
    app = create_app(settings, artifact, on_fatal=lambda: holder[0].fail())
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, workers=1, lifespan="on",
        log_level=settings.log_level,
        timeout_graceful_shutdown=math.ceil(settings.drain_timeout + ABORT_GRACE_S),
        access_log=settings.log_level == "debug")
    server = DrainingServer(config, settings.drain_timeout)
    holder.append(server)
    server.run()
    return server.exit_code
