"""Offload runs work in another process, at a lower CPU priority, and restarts after shutdown;
the attention path's own settings reach its session, gate and worker pool."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from service.artifact.loader import open_artifact
from service.http.metrics import Metrics
from service.http.routes.attention import encode_json
from service.http.runtime import Runtime, load_engine
from service.http.validation import Validator
from service.low_priority import Offload
from service.settings import Settings


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


def test_the_attention_session_has_its_own_thread_count(artifact: Path) -> None:
    """ATTNSERVE_ATTENTION_THREADS sizes attention.onnx's pool apart from the decode one."""
    settings = Settings(model=artifact, device="cpu", intra_op_threads=2, attention_threads=1,
                        attention_max_concurrent=3, attention_max_queued=2)
    opened = open_artifact(settings)
    runtime = Runtime(settings, opened, Metrics(), Validator(
        opened.codec, opened.limits, opened.config.eos_token_id,
        opened.config.generation.max_new_tokens))
    load_engine(runtime)
    assert runtime.attention is not None and runtime.engine is not None
    assert runtime.attention.session.get_session_options().intra_op_num_threads == 1
    decode = runtime.engine.runner.session  # type: ignore[attr-defined]
    assert decode.get_session_options().intra_op_num_threads == 2
    gate = runtime.attention_gate
    assert (gate.max_running, gate.max_waiting, runtime.attention_encoder.workers) == (3, 2, 3)


def test_low_priority_threads_run_ten_nice_levels_below_the_process() -> None:
    """Read back from the OS: the pool's thread has nice + 10, the caller is unchanged."""
    import threading

    from service.low_priority import low_priority_threads

    def nice_of_this_thread() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = nice_of_this_thread()
    pool = low_priority_threads(1, "test-attention")
    try:
        inside = pool.submit(nice_of_this_thread).result()
    finally:
        pool.shutdown()
    assert inside == min(before + 10, 19)
    assert nice_of_this_thread() == before
