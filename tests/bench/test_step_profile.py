"""benchmarks/step_profile.py's summary of ONNX Runtime profiles, on a hand-written profile
in ONNX Runtime's format (the engine run itself is the benchmark's, not a test's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.step_profile import by_op, main, node_medians


def _event(cat: str, name: str, dur: float, op: str | None = None) -> dict[str, object]:
    event: dict[str, object] = {"cat": cat, "name": name, "dur": dur, "ts": 0, "ph": "X"}
    if op is not None:
        event["args"] = {"op_name": op}
    return event


def test_medians_per_node_and_sums_per_op(tmp_path: Path) -> None:
    # a prompt's pass (slow) then two decode steps, over two sessions' files
    first = [_event("Session", "model_run", 900.0),
             _event("Node", "lm_head_kernel_time", 500.0, "GgufMatMul"),
             _event("Node", "lm_head_fence_before", 1.0, "GgufMatMul"),
             _event("Node", "l0.qkv_kernel_time", 300.0, "GgufMatMul"),
             _event("Node", "l0.attn_kernel_time", 80.0, "GroupQueryAttention"),
             _event("Node", "lm_head_kernel_time", 100.0, "GgufMatMul"),
             _event("Node", "l0.qkv_kernel_time", 20.0, "GgufMatMul")]
    second = [_event("Node", "lm_head_kernel_time", 110.0, "GgufMatMul"),
              _event("Node", "l0.qkv_kernel_time", 30.0, "GgufMatMul"),
              _event("Node", "l0.attn_kernel_time", 10.0, "GroupQueryAttention"),
              _event("Node", "l0.attn_kernel_time", 12.0, "GroupQueryAttention")]
    files = []
    for i, events in enumerate((first, second)):
        files.append(tmp_path / f"p{i}.json")
        files[-1].write_text(json.dumps(events), "utf-8")
    medians = node_medians(files)
    assert medians == {"lm_head": ("GgufMatMul", 110.0), "l0.qkv": ("GgufMatMul", 30.0),
                       "l0.attn": ("GroupQueryAttention", 12.0)}
    assert by_op(medians) == [("GgufMatMul", 140.0, 2), ("GroupQueryAttention", 12.0, 1)]


def test_an_artifact_without_a_manifest_is_refused(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--artifact", str(tmp_path)]) == 2
    assert "holds no manifest.json" in capsys.readouterr().err
