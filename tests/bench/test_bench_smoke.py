"""`python -m benchmarks --quick` end to end on the tiny fixtures: files exist and agree.

No timing is asserted (speed is what the benchmark prints); what is asserted is that
every requested engine produced its rows, that the engines ran the same weights (their
greedy tokens equal PyTorch-with-cache's), and that JSON, Markdown and PNG tell the same
story.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.side_by_side import main

ENGINES = ["torch_nocache", "torch_kv", "hf_generate", "ort_plain", "engine", "http"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_quick_bench_writes_consistent_reports(
    tiny_checkpoint: Path, tiny_artifact: Path, tmp_path: Path, capsys
) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "res"
    code = main(["--presets", "tiny", "--quick", "--no-latest", "--out", str(out),
                 "--ckpt", f"tiny={tiny_checkpoint}", "--artifact", f"tiny={tiny_artifact}",
                 "--engines", ",".join(ENGINES), "--batch-sizes", "1,4",
                 "--concurrency", "1,4", "--new-tokens", "8", "--long-new-tokens", "16"])
    assert code == 0
    printed = capsys.readouterr().out

    run = json.loads((out / "results.json").read_text())
    md = (out / "results.md").read_text()
    assert (out / "results.png").read_bytes()[:8] == PNG_MAGIC

    assert run["settings"]["new_tokens"] == 8 and run["settings"]["threads"] == 2
    assert run["ceiling"]["gemm_gflops_best"] > 0 and run["ceiling"]["read_bandwidth_gbs_best"] > 0
    tiny = run["presets"]["tiny"]
    assert tiny["weights"].startswith("trained")
    engines = tiny["engines"]
    for name in ENGINES[:-1]:
        assert "error" not in engines[name], engines[name]
        batches = [r["batch"] for r in engines[name]["rows"]]
        assert batches == ([1] if name == "torch_nocache" else [1, 4]) or (
            name == "torch_nocache" and batches == [1, 4])
        for row in engines[name]["rows"]:
            assert row["new_tokens"] == 8 and row["tokens_per_s"] > 0
            # Same weights, same greedy path: every engine reproduces PyTorch with cache.
            assert row["greedy_rows_equal_torch_kv"] == 1.0, (name, row)
        assert engines[name]["memory"]["peak_mb"] >= engines[name]["memory"]["after_import_mb"]
    assert tiny["kv_vs_nocache"]["same_tokens"] is True
    assert tiny["kv_vs_nocache"]["new_tokens"] == 16

    http = tiny["http"]
    assert "error" not in http, http
    assert [r["concurrency"] for r in http["rows"]] == [1, 4]
    for row in http["rows"]:
        assert row["prompt_tokens_seen"] in ([], [64])  # the text prompts are 64 tokens
        assert 0 < row["mean_generated_tokens"] <= 8
    assert http["ttft_ms"] > 0

    # Every figure in the JSON table shows up in the Markdown table, and every target
    # is printed once with a verdict.
    hf_row = engines["hf_generate"]["rows"][0]
    assert f"| 3 transformers generate | 1 | {hf_row['tokens_per_s']:.1f} | 1.00 |" in md
    assert md.count("| 6 HTTP service c=") == 2
    statuses = [t["status"] for t in tiny["targets"]]
    assert set(statuses) <= {"PASS", "MISS", "NOT MEASURED"}
    assert printed.count("[tiny] ") == len(statuses)
    optimum = [t for t in tiny["targets"] if "Optimum" in t["target"]]
    assert optimum and all(t["status"] == "NOT MEASURED" for t in optimum)
