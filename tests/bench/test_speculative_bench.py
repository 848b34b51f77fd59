"""benchmarks/speculative.py end to end on the tiny artifact: greedy text with speculation on
equals off for every prompt, and the counts it reports add up. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPETITIVE = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
              "To be, or not to be. To be, or not to be. To be,"]
CHAT = ["The meaning of", "ROMEO:"]



@pytest.mark.parametrize("adaptive", [True, False], ids=["adaptive", "every-step"])
def test_speculative_benchmark_reports_identical_text_and_consistent_counts(
        tiny_artifact: Path, tmp_path: Path, adaptive: bool) -> None:
    out = tmp_path / "spec.json"
    prompts = tmp_path / "prompts.json"  # short: the tiny model's context is 128 tokens
    prompts.write_text(json.dumps({"repetitive": REPETITIVE, "chat": CHAT}))
    cmd = [sys.executable, "-m", "benchmarks.speculative", "--artifact", str(tiny_artifact),
           "--threads", "1", "--reps", "1", "--max-new", "12", "--k", "3",
           "--prompts", str(prompts), "--out", str(out)]
    done = subprocess.run([*cmd, *([] if adaptive else ["--no-adaptive"])],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["adaptive"] is adaptive and report["num_speculative_tokens"] == 3
    for name in ("repetitive", "chat"):
        s = report["sets"][name]
        assert s["identical"], name
        assert len(s["prompts"]) == 2
        assert 0 <= s["accepted"] <= s["drafted"]
        assert s["acceptance_rate"] == (s["accepted"] / s["drafted"] if s["drafted"] else 0.0)
        assert s["speedup"] == pytest.approx(s["on_tok_s"] / s["off_tok_s"])
        assert f"{name:10s} off" in done.stdout
    if not adaptive:  # every step proposes where prompt lookup finds a match
        assert report["sets"]["repetitive"]["drafted"] > 0


def test_a_malformed_prompt_file_is_one_line_and_nonzero(tiny_artifact: Path,
                                                         tmp_path: Path) -> None:
    bad = tmp_path / "prompts.json"
    bad.write_text('{"chat": "not a list"}')
    done = subprocess.run([sys.executable, "-m", "benchmarks.speculative", "--artifact",
                           str(tiny_artifact), "--prompts", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        f'--prompts {bad}: expected {{"set name": ["prompt", ...]}}']
