"""CPU-heavy /attention work at a lower CPU priority: the session run in low-priority
threads, the response encoding in low-priority worker processes.

A full-size /attention JSON answer is ~60 MB built from Python floats: about 10 s of
GIL-holding work. In a thread of the serving process it takes the GIL from the decode loop
between every ONNX Runtime call, so each decode step waits on it; measured, one such
request at a time still tripled the decode p99 inter-token latency. In a child process it
has its own GIL, and ``nice`` lets the OS give the decode threads the cores first. The
pool starts on first use (spawned, so no engine threads are forked) and holds
``workers`` processes; the arguments and the result travel pickled.

The attention session itself runs in threads of the serving process whose own nice value
is raised (Linux schedules threads, and a thread id is a valid PRIO_PROCESS target): on
two cores, a one-thread attention.onnx run at normal priority takes a core from the decode
session's two ONNX Runtime threads for its whole run, and every decode step waits for the
descheduled one; at +10 the decode threads get the cores first.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


def _lower_priority(niceness: int) -> None:
    if niceness:
        os.nice(niceness)


def lower_thread_priority(niceness: int) -> None:
    """Raise the calling thread's nice value by ``niceness`` (Linux; elsewhere a no-op)."""
    if not niceness or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):  # not permitted here: the process's priority it is
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + niceness)


def low_priority_threads(workers: int, name: str, niceness: int = 10) -> ThreadPoolExecutor:
    """A thread pool whose threads run ``niceness`` below the rest of the process."""
    return ThreadPoolExecutor(workers, thread_name_prefix=name,
                              initializer=lower_thread_priority, initargs=(niceness,))


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
