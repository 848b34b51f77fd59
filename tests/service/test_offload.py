"""Offload runs work in another process, at a lower CPU priority, and restarts after shutdown."""

from __future__ import annotations

import os

import numpy as np

from service.offload import Offload
from service.routes.attention import encode_json


def test_work_runs_in_a_lower_priority_process_and_returns_its_result() -> None:
    offload = Offload(1, niceness=3)
    try:
        assert offload.call(os.getpid) != os.getpid()
        assert offload.call(os.nice, 0) == os.nice(0) + 3
        arrays = {"weights": np.tril(np.ones((1, 2, 3, 3), np.float32)) / 3}
        head = {"model": "m"}
        assert offload.call(encode_json, head, arrays) == encode_json(head, arrays)
    finally:
        offload.shutdown()
    try:
        assert offload.call(os.getpid) != os.getpid()  # a fresh pool after shutdown
    finally:
        offload.shutdown()
