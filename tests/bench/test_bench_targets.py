"""The benchmark's per-preset targets and KV-cache figures on a synthetic result, against
figures worked out by hand."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.lib.harness import kv_cache_comparison
from benchmarks.lib.report import evaluate_targets


def row(batch: int, tps: float, decode: float | None = None) -> dict[str, Any]:
    return {"batch": batch, "tokens_per_s": tps, "decode_tokens_per_s": decode or tps}


def test_kv_bytes_per_token_follow_the_key_value_heads() -> None:
    smollm2 = {"n_layers": 30, "n_heads": 9, "n_kv_heads": 3, "d_model": 576}
    # 30 layers × (K and V) × 3 kv heads × 64 dims × 4 bytes; GPT-2: 12 × 2 × 12 × 64 × 4
    assert kv_cache_comparison("smollm2-135m", smollm2) == {"smollm2-135m": 46_080,
                                                            "gpt2": 73_728}
    assert kv_cache_comparison("gpt2", {"n_layers": 12, "n_heads": 12, "d_model": 768}) == {
        "gpt2": 73_728}


def test_smollm2_targets_are_ratios_to_ctranslate2_transformers_and_fp32() -> None:
    preset = {"params": 100_000_000, "engines": {
        "hf_generate": {"rows": [row(1, 10.0), row(32, 100.0)]},
        "ct2": {"rows": [row(1, 25.0), row(32, 120.0)]},
        "engine": {"rows": [row(1, 31.0, 40.0), row(32, 210.0)]},
        "engine_int8": {"rows": [row(1, 45.0), row(32, 230.0)]},
    }, "int8_agreement": {"token_agreement": 0.99}}
    ceiling = {"read_bandwidth_gbs_best": 20.0}
    got = {t["target"]: t for t in evaluate_targets(preset, ceiling, "smollm2-135m")}
    checks = {name: (t["status"], t["value"]) for name, t in got.items()}
    assert checks["4 our engine (fp32) vs 7 CTranslate2 (fp32), batch 1"] == ("PASS", 1.24)
    assert checks["4 our engine (fp32) vs 3 transformers generate, batch 1"] == ("PASS", 3.1)
    assert checks["4 our engine (fp32) vs 7 CTranslate2 (fp32), batch 32"] == ("PASS", 1.75)
    assert checks["4 our engine (fp32) vs 3 transformers generate, batch 32"] == ("PASS", 2.1)
    status, value = checks["5 our engine (int8) vs 4 our engine (fp32), batch 1"]
    assert status == "MISS" and value == pytest.approx(45 / 31)
    # 1e8 parameters × 4 bytes × 40 decode tok/s ÷ 20 GB/s = 80 %
    status, value = checks["batch-1 fp32 decode share of the memory-bandwidth bound"]
    assert status == "PASS" and value == pytest.approx(80.0)


def test_real_smollm2_targets_set_ours_beside_llamacpp_on_the_same_file() -> None:
    preset = {"params": 100_000_000, "engines": {
        "llamacpp_q4_1": {"rows": [row(1, 50.0), row(8, 100.0), row(32, 120.0)]},
        "llamacpp_q8_0": {"rows": [row(1, 40.0)]},
        "llamacpp_f32": {"rows": [row(1, 20.0)]},
        "engine": {"rows": [row(1, 30.0), row(8, 150.0), row(32, 200.0)]},
        "engine_int8": {"rows": [row(1, 50.0), row(8, 140.0), row(32, 260.0)]},
        "engine_int4": {"rows": [row(1, 65.0), row(8, 160.0), row(32, 250.0)]},
    }, "int8_agreement": {"token_agreement": 0.98}}
    got = {t["target"]: (t["status"], t["value"])
           for t in evaluate_targets(preset, {}, "smollm2-135m-instruct")}
    q41 = "8 llama.cpp (shipped Q4_1 GGUF)"
    assert got[f"5 our engine (int4) vs {q41}, batch 1"] == ("PASS", 1.3)  # 65 / 50
    assert got[f"5 our engine (int4) vs {q41}, batch 32"] == ("PASS", 250 / 120)
    assert got["5 our engine (int8) vs 8 llama.cpp (q8_0 GGUF), batch 1"] == ("PASS", 1.25)
    assert got["4 our engine (fp32) vs 8 llama.cpp (f32 GGUF), batch 1"] == ("PASS", 1.5)
    # int8 at batch 8 is slower than fp32 (140 < 150): the "never slower" target misses.
    assert got["5 our engine (int8) vs 4 our engine (fp32), batch 8"] == ("MISS", 140 / 150)
    assert got["5 our engine (int4) vs 4 our engine (fp32), batch 32"] == ("PASS", 1.25)
    assert got[f"5 our engine (GGUF blocks) vs {q41}, batch 1"][0] == "NOT MEASURED"
    assert got["int8 greedy agreement (real weights)"] == ("PASS", 98.0)


def test_same_file_table_sets_each_precision_beside_llamacpp() -> None:
    from benchmarks.lib.report import same_file_lines

    preset = {"params": 1, "engines": {
        "llamacpp_q4_1": {"rows": [{**row(1, 50.0), "own": {"decode_tokens_per_s": 60.0}},
                                   {**row(32, 120.0), "own": {"decode_tokens_per_s": 130.0}}]},
        "engine_int4": {"rows": [row(1, 65.0), row(32, 250.0)]},
    }, "llamacpp_agreement": {"llamacpp_q4_1": {"token_agreement": 0.95, "positions": 1024}},
        "quant_agreement": {"int4": {"token_agreement": 0.9, "positions": 1024}}}
    lines = same_file_lines(preset)
    assert "| int4 / Q4_1 | 65.0 / 250.0 | 50.0 / 120.0 | 1.30 / 2.08 | 60.0 / 130.0 | 90.0% | " \
           "95.0% |" in lines
    assert not any(line.startswith("| int8 / q8_0") for line in lines)  # neither side ran
