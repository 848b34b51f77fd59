"""The helpers the benchmarks share: a server started for a run (benchmarks/lib/serving.py:
``started``), the process memory figures and the one ``--threads`` default
(benchmarks/lib/measure.py)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from benchmarks.lib.measure import (
    DEFAULT_THREADS,
    add_threads_option,
    proc_memory_bytes,
    proc_memory_mb,
)
from benchmarks.lib.serving import started


def test_a_server_that_never_gets_ready_is_one_line_naming_the_benchmark(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as stopped, started(tmp_path / "missing", 8393, [], "soak"):
        pytest.fail("a server of a missing artifact got ready")
    message = str(stopped.value.code)
    assert message.startswith("soak: the server exited with ") and "\n" not in message


def test_memory_figures_are_this_process_s_status_lines() -> None:
    memory = proc_memory_bytes(os.getpid())
    assert memory["VmHWM"] >= memory["VmRSS"] > 0
    assert memory["RssAnon"] + memory["RssFile"] <= memory["VmRSS"]
    assert set(proc_memory_mb()) == {"VmRSS", "VmHWM"}
    assert proc_memory_bytes(2**22 + 1) == {}  # above Linux's largest pid: no such process


def test_every_benchmark_s_threads_option_has_the_one_default() -> None:
    parser = argparse.ArgumentParser()
    add_threads_option(parser, "llama-quantize threads")
    assert parser.parse_args([]).threads == DEFAULT_THREADS
    assert parser.parse_args(["--threads", "8"]).threads == 8
