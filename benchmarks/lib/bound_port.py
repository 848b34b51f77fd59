"""`attnserve serve` on port 0, reporting the port the kernel gave it.

A port picked by the caller (bind to port 0, close, pass ``--port N``) and bound by the
server later can be taken by another process in between. A server that binds port 0 itself
cannot lose its port; the caller only has to learn which one it got. uvicorn logs it
("Uvicorn running on ...") only at log level info, and the benchmarks serve at warning, so
this launcher writes it to a file instead, right after uvicorn starts listening.

Usage: python benchmarks/lib/bound_port.py PORT_FILE serve --model DIR --port 0 ...

Run as a script, it imports only the service (never the benchmarks package): the server
runs exactly as `attnserve serve ...` does. ``wait_bound_port`` and ``wait_ready`` are the
caller's side (benchmarks/lib/serving.py starts the benchmarks' servers with them).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from email.message import Message
from pathlib import Path
from typing import Any

LAUNCHER = Path(__file__).resolve()


def http_get(url: str, timeout: float = 10.0) -> tuple[str, Message]:
    """(text, headers) of a GET answered 2xx, else an OSError (refused, timed out, an error
    status): the benchmarks' plain reads (/ready, /metrics, /info, /v1/models), which need
    no load client."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode(), response.headers


def report_bound_port(path: str) -> None:
    """Write the port uvicorn bound to ``path`` once it listens (atomically: the file
    appears whole, so a reader never sees part of a number)."""
    import uvicorn

    startup = uvicorn.Server.startup

    async def reporting_startup(self: Any, sockets: Any = None) -> None:
        await startup(self, sockets)
        if self.started:
            port = self.servers[0].sockets[0].getsockname()[1]
            with open(f"{path}.tmp", "w") as out:
                out.write(str(port))
            os.replace(f"{path}.tmp", path)

    uvicorn.Server.startup = reporting_startup  # type: ignore[method-assign]


def _tail(log: Path | None) -> str:
    """The end of the server's log, for an error that says why it stopped."""
    return f":\n{log.read_text(errors='replace')[-3000:]}" if log and log.exists() else ""


def wait_bound_port(proc: subprocess.Popen[bytes], port_file: Path, timeout: float,
                    log: Path | None = None) -> int:
    """The port ``proc`` reported in ``port_file`` (bounded wait; fails early if it exits)."""
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before listening"
                               f"{_tail(log)}")
        if time.monotonic() >= deadline:
            raise RuntimeError(f"the server reported no port within {timeout:.0f} s{_tail(log)}")
        time.sleep(0.05)
    return int(port_file.read_text())


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float,
               log: Path | None = None, interval: float = 0.2, probe: str = "/ready") -> None:
    """Until ``url`` + ``probe`` answers 200 (bounded; fails early, with the log's tail, if
    ``proc`` exits): the one readiness wait of the benchmarks and the tests (``probe``
    "/health" for llama-server)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before ready{_tail(log)}")
        try:
            http_get(f"{url}{probe}", timeout=2.0)
            return
        except OSError:  # not listening yet, or not ready (503)
            pass
        time.sleep(interval)
    raise RuntimeError(f"the server was not ready after {timeout:.0f} s{_tail(log)}")


def main(argv: list[str]) -> int:
    port_file, *cli_args = argv
    report_bound_port(port_file)
    from service.cli import main as cli_main

    return cli_main(cli_args)


if __name__ == "__main__":
    if sys.path and Path(sys.path[0]).resolve() == LAUNCHER.parent:
        del sys.path[0]  # benchmarks/lib/ modules must not shadow what the service imports
    sys.exit(main(sys.argv[1:]))
