"""A 4-bit artifact's weights as 8-bit codes (engine_codes8.onnx) for passes of many rows.

The widened graph holds the very values of the 4-bit one (export/widen_codes.py, checked
against numpy in tests/export/test_widen_codes.py); here: export writes it and records its
threshold, it agrees with the 4-bit graph it came from (fed the same tokens), and the
runner sends each pass to the graph its size calls for, with the same logits as the 4-bit
graph gives that pass (a runner with the codes off is the reference).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest

from model.checkpoint import load_checkpoint
from service.contract import io_spec as io
from service.contract.engine_spec import ENGINE_CODES8_FILE, ENGINE_FILE, ENGINE_MIXED_FILE
from service.engine.engine import EngineConfig, create_runner
from service.engine.static_cache import EngineGraphRunner
from tests.service.conftest import ServerProcess

MANY = 6  # tokens from which a pass runs on the 8-bit codes, in these tests
WIDE = 40  # and from which on the float32 twin


def runner_for(artifact: Path, codes8: int | None, wide: int = WIDE,
               mixed_steps: bool = True) -> EngineGraphRunner:
    runner = create_runner(artifact, io.ArtifactConfig.load(artifact), EngineConfig(
        intra_op_threads=1, max_batch_size=8, prefix_caching=False, mixed_steps=mixed_steps,
        float32_pass_tokens=wide, codes8_pass_tokens=codes8))
    assert isinstance(runner, EngineGraphRunner)
    return runner


def test_export_writes_the_codes_and_their_threshold(int4_artifact: Path) -> None:
    manifest = json.loads((int4_artifact / io.MANIFEST_FILE).read_text("utf-8"))
    assert ENGINE_CODES8_FILE in manifest["files"]
    assert manifest["exporter"]["codes8_pass_tokens"] == 16
    widened = onnx.load(str(int4_artifact / ENGINE_CODES8_FILE), load_external_data=False)
    served = onnx.load(str(int4_artifact / ENGINE_MIXED_FILE), load_external_data=False)
    bits = [{a.name: a.i for a in n.attribute}["bits"]
            for n in widened.graph.node if n.op_type == "MatMulNBits"]
    assert bits and set(bits) == {8}
    assert [i.name for i in widened.graph.input] == [i.name for i in served.graph.input]
    assert sorted(p.name for p in int4_artifact.glob("*.bin")) == ["weights.bin"]
    assert runner_for(int4_artifact, None).codes8_pass_tokens == 16  # the artifact's


def test_the_codes_agree_with_the_four_bit_graph(int4_artifact: Path,
                                                 tiny_checkpoint: Path) -> None:
    """What export's verification runs: both graphs fed the same tokens."""
    from export.widen_codes import compare_widened

    gpt = load_checkpoint(tiny_checkpoint).model.eval()
    result = compare_widened(gpt, int4_artifact / ENGINE_MIXED_FILE,
                             int4_artifact / ENGINE_CODES8_FILE,
                             [[5, 17, 9, 31, 2], [40, 41, 42]], steps=6)
    assert result["greedy_equal"] and result["max_abs_diff"] <= 1e-4 * result["logit_scale"]


@pytest.mark.parametrize("mixed_steps", [True, False])
def test_each_pass_runs_on_the_graph_its_size_calls_for(int4_artifact: Path,
                                                        mixed_steps: bool) -> None:
    """Below MANY tokens: the 4-bit graph; MANY up to WIDE: the 8-bit codes; WIDE and
    more: the float32 twin. Logits of the codes' passes equal the 4-bit graph's."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 300, n) for n in (MANY - 1, MANY, 12)]
    plain = runner_for(int4_artifact, 0, mixed_steps=mixed_steps)  # codes off: the reference
    mixed = runner_for(int4_artifact, MANY, mixed_steps=mixed_steps)
    assert mixed.graph_file == (ENGINE_MIXED_FILE if mixed_steps else ENGINE_FILE)

    expected_passes = 0
    slots: dict[str, list] = {"plain": [], "mixed": []}
    for prompt in prompts:  # one prompt a pass
        slots["plain"] += plain.reserve(1)
        slots["mixed"] += mixed.reserve(1)
        want = plain.prefill(slots["plain"][-1:], [prompt])[0]
        got = mixed.prefill(slots["mixed"][-1:], [prompt])[0]
        expected_passes += len(prompt) >= MANY
        assert mixed.codes8_passes == expected_passes
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert plain.codes8_passes == 0

    # decode steps: 3 rows on the 4-bit graph; 6 rows, one token each, on the codes
    extra = [rng.integers(3, 300, 4) for _ in range(3)]
    for name, runner in (("plain", plain), ("mixed", mixed)):
        for prompt in extra:  # three more rows, six in all
            slots[name] += runner.reserve(1)
            runner.prefill(slots[name][-1:], [prompt])
    steps = {}
    for name, runner in (("plain", plain), ("mixed", mixed)):
        rows = slots[name]
        before = runner.codes8_passes
        few = runner.decode(rows[:3], np.array([7, 8, 9]))
        between = runner.codes8_passes
        many = runner.decode(rows, np.arange(10, 10 + len(rows)))
        steps[name] = (few, many, between - before, runner.codes8_passes - between)
    assert steps["mixed"][2:] == (0, 1) and steps["plain"][2:] == (0, 0)
    np.testing.assert_allclose(steps["mixed"][0], steps["plain"][0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(steps["mixed"][1], steps["plain"][1], rtol=1e-5, atol=1e-5)

    mixed.prefill(mixed.reserve(1), [rng.integers(3, 300, WIDE)])  # the twin's
    assert mixed.twin_passes == 1 and mixed.codes8_passes == expected_passes + 1


def test_codes_off_load_nothing(int4_artifact: Path) -> None:
    runner = runner_for(int4_artifact, 0)
    assert not runner.has_codes8 and runner._codes8 is None


def test_the_server_says_which_passes_run_where(
        int4_artifact: Path, start_server: Callable[..., ServerProcess]) -> None:
    """/info gives both thresholds (the artifact's by default); --codes8-pass-tokens 0
    turns the codes off; a request is answered either way, with the same greedy text."""
    import httpx

    prompt = "First Citizen:\nBefore we proceed any further, hear me speak."
    texts = []
    for args, codes8 in (((), 16), (("--codes8-pass-tokens", "0"), None)):
        server = start_server(*args, model=int4_artifact)
        info = httpx.get(f"{server.url}/info", timeout=10).json()
        assert (info["float32_pass_tokens"], info["codes8_pass_tokens"]) == (512, codes8)
        ids = httpx.post(f"{server.url}/tokenize", timeout=10, json={"prompt": prompt}).json()
        assert ids["count"] >= 16  # its prefill is a pass for the codes when they are on
        reply = httpx.post(f"{server.url}/generate", timeout=60, json={
            "inputs": prompt, "parameters": {"max_new_tokens": 8}})
        assert reply.status_code == 200, reply.text
        texts.append(reply.json()["generated_text"])
    assert texts[0] == texts[1]  # the same weights either way
