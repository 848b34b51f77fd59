"""CPU-heavy response encoding in worker processes at a lower CPU priority.

A full-size /attention JSON answer is ~60 MB built from Python floats: about 10 s of
GIL-holding work. In a thread of the serving process it takes the GIL from the decode loop
between every ONNX Runtime call, so each decode step waits on it; measured, one such
request at a time still tripled the decode p99 inter-token latency. In a child process it
has its own GIL, and ``nice`` lets the OS give the decode threads the cores first. The
pool starts on first use (spawned, so no engine threads are forked) and holds
``workers`` processes; the arguments and the result travel pickled.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


def _lower_priority(niceness: int) -> None:
    if niceness:
        os.nice(niceness)


class Offload:
    def __init__(self, workers: int, niceness: int = 10) -> None:
        self.workers = workers
        self.niceness = niceness
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker process; blocks the calling (worker) thread."""
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    self.workers, mp_context=multiprocessing.get_context("spawn"),
                    initializer=_lower_priority, initargs=(self.niceness,))
            pool = self._pool
        return pool.submit(fn, *args).result()

    def shutdown(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
