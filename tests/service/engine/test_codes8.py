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
from service.contract.engine_spec import (
    ENGINE_CODES8_FILE,
    ENGINE_CODES8_PLAIN_FILE,
    ENGINE_FILE,
    ENGINE_FLOAT32_FILE,
    ENGINE_MIXED_FILE,
)
from service.engine.engine import EngineConfig, create_runner
from service.engine.engine_graph_runner import EngineGraphRunner
from service.engine.kv_pool import Slot
from tests.service.helpers import ServerProcess

ROWS = 4  # rows from which a pass runs on the 8-bit codes, in these tests
PROMPT = 12  # tokens from which a pass of fewer rows does
WIDE = 40  # and from which on the float32 twin


def runner_for(artifact: Path, codes8: int | None, wide: int = WIDE,
               mixed_steps: bool = True) -> EngineGraphRunner:
    runner = create_runner(artifact, io.ArtifactConfig.load(artifact), EngineConfig(
        intra_op_threads=1, max_batch_size=8, prefix_caching=False, mixed_steps=mixed_steps,
        float32_pass_tokens=wide, codes8_pass_rows=codes8))
    assert isinstance(runner, EngineGraphRunner)
    return runner


def test_export_writes_the_codes_and_their_threshold(int4_artifact: Path) -> None:
    manifest = json.loads((int4_artifact / io.MANIFEST_FILE).read_text("utf-8"))
    assert ENGINE_CODES8_FILE in manifest["files"]
    assert manifest["exporter"]["codes8_pass_rows"] == 16
    assert manifest["exporter"]["codes8_prompt_tokens"] == 128
    widened = onnx.load(str(int4_artifact / ENGINE_CODES8_FILE), load_external_data=False)
    served = onnx.load(str(int4_artifact / ENGINE_MIXED_FILE), load_external_data=False)
    bits = [{a.name: a.i for a in n.attribute}["bits"]
            for n in widened.graph.node if n.op_type == "MatMulNBits"]
    assert bits and set(bits) == {8}
    assert [i.name for i in widened.graph.input] == [i.name for i in served.graph.input]
    # engine.onnx's own, over the same stored weights
    assert ENGINE_CODES8_PLAIN_FILE in manifest["files"]
    plain_widened = onnx.load(str(int4_artifact / ENGINE_CODES8_PLAIN_FILE),
                              load_external_data=False)
    plain = onnx.load(str(int4_artifact / ENGINE_FILE), load_external_data=False)
    assert [i.name for i in plain_widened.graph.input] == [i.name for i in plain.graph.input]
    assert {{a.name: a.i for a in n.attribute}["bits"] for n in plain_widened.graph.node
            if n.op_type == "MatMulNBits"} == {8}

    def weights(model: onnx.ModelProto) -> set[str]:
        return {t.name for t in model.graph.initializer if t.name.endswith(".codes8")}
    assert weights(plain_widened) == weights(widened)  # one copy in weights.bin
    assert sorted(p.name for p in int4_artifact.glob("*.bin")) == ["weights.bin"]
    runner = runner_for(int4_artifact, None)
    assert (runner.codes8_pass_rows, runner.codes8_prompt_tokens) == (16, 128)  # the artifact's


def test_the_codes_agree_with_the_four_bit_graph(int4_artifact: Path,
                                                 tiny_checkpoint: Path) -> None:
    """What export's verification runs: both graphs fed the same tokens."""
    from export.widen_codes import compare_widened

    gpt = load_checkpoint(tiny_checkpoint).model.eval()
    result = compare_widened(gpt, int4_artifact / ENGINE_MIXED_FILE,
                             int4_artifact / ENGINE_CODES8_FILE,
                             [[5, 17, 9, 31, 2], [40, 41, 42]], steps=6)
    assert result["greedy_equal"] and result["max_abs_diff"] <= 1e-4 * result["logit_scale"]


def test_the_comparison_refuses_other_weights(int4_artifact: Path,
                                              tiny_checkpoint: Path) -> None:
    """The float32 twin computes the same model from unrounded weights: its logits are
    further than 1e-4 of their scale from the 4-bit graph's, so it is not the same graph."""
    from export.widen_codes import compare_widened

    gpt = load_checkpoint(tiny_checkpoint).model.eval()
    with pytest.raises(ValueError, match="disagrees with"):
        compare_widened(gpt, int4_artifact / ENGINE_MIXED_FILE,
                        int4_artifact / ENGINE_FLOAT32_FILE, [[5, 17, 9, 31, 2]], steps=3)


@pytest.mark.parametrize("mixed_steps", [True, False])
def test_each_pass_runs_on_the_graph_its_size_calls_for(int4_artifact: Path,
                                                        mixed_steps: bool) -> None:
    """Fewer than ROWS rows and PROMPT tokens: the 4-bit graph; ROWS rows or PROMPT tokens
    (below WIDE): the 8-bit codes; WIDE tokens: the float32 twin. The codes' logits are
    the 4-bit graph's."""
    rng = np.random.default_rng(0)
    plain = runner_for(int4_artifact, 0, mixed_steps=mixed_steps)  # codes off: the reference
    mixed = runner_for(int4_artifact, ROWS, mixed_steps=mixed_steps)
    mixed.codes8_prompt_tokens = PROMPT
    assert mixed.graph_file == (ENGINE_MIXED_FILE if mixed_steps else ENGINE_FILE)
    assert mixed._codes8 is not None  # no idle second group beside a plain engine.onnx
    assert mixed._codes8.mixes_chunks == mixed_steps
    slots: dict[str, list[Slot]] = {"plain": [], "mixed": []}

    def both(feed: Callable[[EngineGraphRunner, list[Slot]], np.ndarray], rows: int,
             on_codes: bool) -> None:
        """One pass on each runner over ``rows`` slots (new ones when reserved here)."""
        before = mixed.codes8_passes
        outputs = []
        for name, runner in (("plain", plain), ("mixed", mixed)):
            outputs.append(np.asarray(feed(runner, slots[name][-rows:])))
        assert mixed.codes8_passes - before == on_codes
        np.testing.assert_allclose(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)

    def prompts(lengths: list[int]) -> Callable[[EngineGraphRunner, list[Slot]], np.ndarray]:
        fed = [rng.integers(3, 300, n) for n in lengths]

        def feed(runner: EngineGraphRunner, _: list[Slot]) -> np.ndarray:
            name = "plain" if runner is plain else "mixed"
            new = runner.reserve(len(fed))
            slots[name] += new
            return np.concatenate(runner.prefill(new, fed))
        return feed

    both(prompts([PROMPT - 1]), 1, on_codes=False)  # one row, 11 tokens
    both(prompts([PROMPT]), 1, on_codes=True)  # one row, 12 tokens
    both(prompts([4, 4]), 2, on_codes=False)  # two rows, 8 tokens
    both(prompts([3]), 1, on_codes=False)  # five rows held now
    tokens = np.arange(10, 10 + ROWS)
    both(lambda r, s: r.decode(s, tokens[:ROWS - 1]), ROWS - 1, on_codes=False)
    both(lambda r, s: r.decode(s, tokens), ROWS, on_codes=True)
    assert plain.codes8_passes == 0

    passes = mixed.codes8_passes
    mixed.prefill(mixed.reserve(1), [rng.integers(3, 300, WIDE)])  # the twin's
    assert mixed.twin_passes == 1 and mixed.codes8_passes == passes


def test_codes_off_load_nothing(int4_artifact: Path) -> None:
    runner = runner_for(int4_artifact, 0)
    assert runner.codes8_rows is None and runner._codes8 is None


def test_the_server_says_which_passes_run_where(
        int4_artifact: Path, start_server: Callable[..., ServerProcess]) -> None:
    """/info gives both thresholds (the artifact's by default); --codes8-pass-rows 0
    turns the codes off; 16 concurrent requests (decode steps of up to 16 rows: the codes'
    when on) get the same greedy texts either way."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    prompts = [f"First Citizen:\nBefore we proceed any further, hear me {i}." for i in range(16)]
    texts = []
    for args, codes8 in (((), 16), (("--codes8-pass-rows", "0"), None)):
        server = start_server(*args, model=int4_artifact)
        info = httpx.get(f"{server.url}/info", timeout=10).json()
        assert (info["float32_pass_tokens"], info["codes8_pass_rows"]) == (512, codes8)

        def generate(prompt: str, url: str = server.url) -> str:
            reply = httpx.post(f"{url}/generate", timeout=120, json={
                "inputs": prompt, "parameters": {"max_new_tokens": 24}})
            assert reply.status_code == 200, reply.text
            return str(reply.json()["generated_text"])

        with ThreadPoolExecutor(16) as pool:
            texts.append(list(pool.map(generate, prompts)))
    assert texts[0] == texts[1]  # the same weights either way
