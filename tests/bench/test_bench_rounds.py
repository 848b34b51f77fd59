"""`python -m benchmarks --rounds N`: every engine measured N times in turn, each row's
figures the median over the rounds and each ratio the median of the per-round ratios,
checked against numpy on synthetic payloads and end to end on the tiny fixtures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.lib.harness import merge_rounds
from benchmarks.lib.report import evaluate_targets, flat_rows, pair_ratio
from benchmarks.side_by_side import main


def payload(tps: float, ttft: float, own: float | None = None,
            peak: float = 100.0) -> dict[str, Any]:
    row: dict[str, Any] = {"batch": 1, "tokens_per_s": tps, "decode_tokens_per_s": tps + 1,
                           "ttft_ms": ttft, "greedy_tokens": [[1, 2]]}
    if own is not None:
        row["own"] = {"decode_tokens_per_s": own, "n_eval": 7}
    return {"result": {"rows": [row], "engine_note": "kept"}, "memory": {"peak_mb": peak}}


def test_rows_take_the_median_over_rounds_and_ratios_the_median_of_ratios() -> None:
    ours = [100.0, 50.0, 90.0]
    theirs = [50.0, 50.0, 30.0]
    a = merge_rounds([payload(t, 10.0 * i, peak=90.0 + i) for i, t in enumerate(ours)])
    b = merge_rounds([payload(t, 5.0, own=t * 2) for t in theirs])
    (ra,), (rb,) = a["rows"], b["rows"]
    assert ra["tokens_per_s"] == np.median(ours) and ra["tokens_per_s_rounds"] == ours
    assert ra["ttft_ms"] == np.median([0.0, 10.0, 20.0]) and ra["rounds"] == 3
    assert ra["decode_tokens_per_s"] == np.median(np.array(ours) + 1)
    assert rb["own"] == {"decode_tokens_per_s": np.median(np.array(theirs) * 2), "n_eval": 7}
    assert a["memory"]["peak_mb"] == 92.0 and a["engine_note"] == "kept"
    assert ra["greedy_tokens"] == [[1, 2]]

    preset = {"params": 1, "engines": {"engine_int4": a, "llamacpp_q4_1": b}}
    rows = flat_rows(preset)
    by_round = np.median(np.array(ours) / np.array(theirs))  # 2.0
    assert pair_ratio(rows, "engine_int4", "llamacpp_q4_1", 1) == pytest.approx(by_round)
    assert by_round != np.median(ours) / np.median(theirs)  # 1.8: not the ratio of medians
    got = {t["target"]: t for t in evaluate_targets(preset, {}, "smollm2-135m-instruct")}
    assert got["5 our engine (int4) vs 8 llama.cpp (shipped Q4_1 GGUF), batch 1"][
        "value"] == pytest.approx(by_round)


def test_one_round_keeps_the_figures_and_a_failed_round_fails_the_engine() -> None:
    one = merge_rounds([payload(42.0, 3.0)])
    assert one["rows"][0]["tokens_per_s"] == 42.0 and "tokens_per_s_rounds" not in one["rows"][0]
    assert merge_rounds([payload(42.0, 3.0), {"error": "worker died: boom"}]) == {
        "error": "worker died: boom"}
    rows = flat_rows({"engines": {"x": one, "y": merge_rounds([payload(21.0, 1.0)])}})
    assert pair_ratio(rows, "x", "y", 1) == 2.0


def test_rounds_run_every_engine_again(tiny_checkpoint: Path, tiny_artifact: Path,
                                      tmp_path: Path) -> None:
    out = tmp_path / "res"
    code = main(["--presets", "tiny", "--quick", "--no-latest", "--out", str(out),
                 "--ckpt", f"tiny={tiny_checkpoint}", "--artifact", f"tiny={tiny_artifact}",
                 "--engines", "torch_kv,engine", "--batch-sizes", "1", "--new-tokens", "4",
                 "--long-new-tokens", "8", "--rounds", "2"])
    assert code == 0
    run = json.loads((out / "results.json").read_text())
    assert run["settings"]["rounds"] == 2
    for name in ("torch_kv", "engine"):
        (row,) = run["presets"]["tiny"]["engines"][name]["rows"]
        rounds = row["tokens_per_s_rounds"]
        assert len(rounds) == 2 and all(v > 0 for v in rounds)
        assert row["tokens_per_s"] == pytest.approx(np.median(rounds))
    assert "measured in 2 rounds" in (out / "results.md").read_text()


def test_rounds_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--presets", "tiny", "--rounds", "0", "--no-latest"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["benchmarks: error: --threads, --prompt-tokens and --rounds must be "
                   "positive"]


def test_a_worker_killed_by_a_signal_is_reported_and_logged(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A peer that crashes natively (llama.cpp's AMX kernel segfaulted on one host) leaves no
    result file: the engine's payload names the signal and the run's log says so, instead
    of the engine silently missing from the table."""
    from benchmarks.lib.harness import BenchOptions, run_worker

    crashing = tmp_path / "python"
    crashing.write_text("#!/bin/sh\necho 'load_tensors: AMX model buffer' >&2\nkill -SEGV $$\n",
                        encoding="utf-8")
    crashing.chmod(0o755)
    out = run_worker({"job": "measure", "engine": "llamacpp_q8_0"}, tmp_path / "jobs",
                     BenchOptions(presets=[], out_dir=tmp_path, latest_dir=None),
                     python=crashing)
    reason = "killed by SIGSEGV; its last words: load_tensors: AMX model buffer"
    assert out == {"error": f"worker died: {reason}"}
    assert f"measure llamacpp_q8_0 failed: worker died: {reason}" in capsys.readouterr().err
