"""A step that raised is a defect unless the test injected it.

The scheduler recovers from a failed step (newcomers prefilled again one by one), so every
answer can still be right while a pass raised: a broken engine invariant then shows only as
a warning in the log and a slower step. conftest's autouse fixture fails any test in which
the engine logged a failed step, unless the test is marked ``step_failures`` (it injected
the fault). Two places are watched: the engine logger of this process (scheduler tests run
the engine in a thread here) and the log files of the servers the tests start
(``ServerProcess`` registers its log with ``watch_server_log``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from service.engine.scheduler import STEP_FAILED

ENGINE_LOGGER = "attnserve.engine"


@dataclass
class _ServerLog:
    path: Path
    running: Callable[[], bool]  # False once the server has exited
    offset: int = 0  # bytes already read


@dataclass
class _Watch:
    handler: logging.Handler
    in_process: list[str] = field(default_factory=list)


_server_logs: dict[Path, _ServerLog] = {}


def watch_server_log(path: Path, running: Callable[[], bool]) -> None:
    """Read ``path`` (a server's log, written from now on) for failed steps after each test."""
    _server_logs[path] = _ServerLog(path, running)


class _Collect(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "step_failure", None) is not None:
            self.into.append(record.getMessage())


def start() -> _Watch:
    """Begin watching: what the engine logs in this process from now on, and every server
    log past what earlier tests read (a server's start in a module fixture counts for the
    test after it). Servers that have exited since are read no more."""
    for path, log in list(_server_logs.items()):
        if not log.running():
            del _server_logs[path]
    into: list[str] = []
    watch = _Watch(_Collect(into), into)
    logging.getLogger(ENGINE_LOGGER).addHandler(watch.handler)
    return watch


def stop(watch: _Watch) -> list[str]:
    """The failed steps logged since ``start``: in this process and in servers' logs."""
    logging.getLogger(ENGINE_LOGGER).removeHandler(watch.handler)
    found = list(watch.in_process)
    for log in _server_logs.values():
        found += [f"{log.path}: {line}" for line in _read_new(log)]
    return found


def _read_new(log: _ServerLog) -> list[str]:
    """The engine's failed-step lines written to ``log`` since its offset (the offset moves)."""
    try:
        with open(log.path, "rb") as f:
            f.seek(log.offset)
            text = f.read()
    except OSError:
        return []
    complete = text.rfind(b"\n") + 1  # a line still being written is read next time
    log.offset += complete
    return [line for line in text[:complete].decode("utf-8", "replace").splitlines()
            if f"{ENGINE_LOGGER} " in line and f"]: {STEP_FAILED} " in line]
