"""benchmarks/steering.py end to end on the tiny checkpoint, one round: its two exports
differ by ``steer`` (checked inside the run), the random vectors are served and applied to
the rows that ask (each steered row's tokens part from its unsteered run, every other
row's stay the same), and the printed and JSON figures hold both parts. Nothing about
speed is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.steering import SCALES, made_from, main
from tests.conftest import torch_threads


def graph_inputs(path: Path) -> set[str]:
    import onnx

    return {i.name for i in onnx.load(str(path), load_external_data=False).graph.input}


def test_one_round_on_the_tiny_model(tiny_checkpoint: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    out, exports = tmp_path / "steering.json", tmp_path / "exports"
    with torch_threads(1):
        code = main(["--ckpt", str(tiny_checkpoint), "--rounds", "1", "--prompt", "8",
                     "--new", "8", "--threads", "1", "--exports", str(exports),
                     "--json", str(out)])
    assert code == 0
    # the exports are kept, one with steer and one without, both of this checkpoint
    assert "steer" in graph_inputs(exports / "steer" / "engine.onnx")
    assert "steer" not in graph_inputs(exports / "plain" / "engine.onnx")
    assert made_from(exports / "steer", tiny_checkpoint)
    assert made_from(exports / "plain", tiny_checkpoint)
    figures = json.loads(out.read_text("utf-8"))
    settings = figures["settings"]
    assert (settings["rows"], settings["steered"], settings["batches"]) == (16, 4, [1, 8, 32])
    assert settings["scales"] == list(SCALES)
    throughput = figures["throughput"]
    [round_] = throughput["rounds"]
    assert round_["first"] == "none"  # round 0 runs A first (B first in odd rounds)
    for arm in ("none", "steered"):
        assert round_[arm]["tokens_per_s"] > 0 and round_[arm]["decode_tokens_per_s"] > 0
    summary = throughput["summary"]
    assert summary["plain_rows_equal"] is True  # the 12 rows under none: the same tokens
    assert summary["steered_rows_changed"] == 4  # each of the 4 vectors moved its row
    assert summary["ratio"] == pytest.approx(
        round_["steered"]["tokens_per_s"] / round_["none"]["tokens_per_s"])
    assert summary["meets_target"] == (summary["ratio"] >= 0.85)
    decode = figures["decode"]
    assert [r["batch"] for r in decode["rounds"]] == [1, 8, 32]
    assert {r["first"] for r in decode["rounds"]} == {"without_steer"}
    assert set(decode["summary"]) == {"1", "8", "32"}
    for row in decode["summary"].values():
        assert row["without_steer"] > 0 and row["with_steer"] > 0
        assert row["ratio"] == pytest.approx(row["with_steer"] / row["without_steer"])
    assert len(figures["load_average"]["start"]) == 3
    printed = capsys.readouterr().out
    assert "steered / none:" in printed and "with / without" in printed
    assert printed.count("round 0 batch") == 3


def test_a_directory_without_a_checkpoint_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--ckpt", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(f"--ckpt {tmp_path}: no checkpoint there (config.json)")
    assert list(tmp_path.iterdir()) == []


def test_more_steered_rows_than_rows_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--rows", "4", "--steered", "5"])
    assert exc.value.code == 2
    assert "--steered must be 1 … --rows (4)" in capsys.readouterr().err
