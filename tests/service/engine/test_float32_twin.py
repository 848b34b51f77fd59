"""A quantised artifact's float32 weights (engine_float32.onnx) for passes of many tokens.

MatMulNBits loses to a float32 GEMM once a pass carries a few dozen rows, so export may keep
the engine graph's float32 build beside the quantised one, and its table of graphs
(service/contract/graphs.py) sends passes of at least ``from_tokens`` tokens to it. Checked
here against PyTorch's float32 model: a wide pass computes its logits, a narrow one does not.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from model.checkpoint import load_checkpoint
from service.contract import io_spec as io
from service.contract.engine_spec import ENGINE_FILE, ENGINE_FLOAT32_FILE, ENGINE_MIXED_FILE
from service.engine.engine import EngineConfig, create_runner
from service.engine.engine_graph_runner import EngineGraphRunner
from tests.conftest import torch_threads
from tests.service.runner_passes import decode, prefill

WIDE = 24  # tokens from which a pass runs on the twin, in these tests


@pytest.fixture(scope="module")
def int8_artifact(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from export.to_onnx import export_artifact

    with torch_threads(1):
        return export_artifact(tiny_checkpoint, tmp_path_factory.mktemp("int8") / "artifact",
                               quantize="int8", engine_graph=True, verify=False,
                               float32_twin=True)


def runner_for(artifact: Path, wide: int | None, mixed_steps: bool = True
               ) -> EngineGraphRunner:
    """The artifact's runner with float32 weights from ``wide`` tokens (None: the
    artifact's threshold)."""
    config = io.ArtifactConfig.load(artifact)
    runner = create_runner(artifact, config, EngineConfig(
        intra_op_threads=1, max_batch_size=4, prefix_caching=False, float32_pass_tokens=wide,
        mixed_steps=mixed_steps))
    assert isinstance(runner, EngineGraphRunner)
    assert runner.graph_file == (ENGINE_MIXED_FILE if mixed_steps else ENGINE_FILE)
    return runner


@torch.no_grad()
def torch_logits(checkpoint: Path, ids: list[int]) -> np.ndarray:
    gpt = load_checkpoint(checkpoint).model.eval()
    return gpt(torch.tensor([ids])).logits[0].numpy()  # (T, V)


def test_export_keeps_the_float32_engine_graph_beside_the_quantised_one(
        int4_artifact: Path) -> None:
    manifest = json.loads((int4_artifact / io.MANIFEST_FILE).read_text("utf-8"))
    assert ENGINE_FLOAT32_FILE in manifest["files"]
    twin = onnx.load(str(int4_artifact / ENGINE_FLOAT32_FILE), load_external_data=False).graph
    quantised = onnx.load(str(int4_artifact / ENGINE_MIXED_FILE),
                          load_external_data=False).graph
    assert not any(n.op_type == "MatMulNBits" for n in twin.node)
    assert any(n.op_type == "MatMulNBits" for n in quantised.node)
    assert [i.name for i in twin.input] == [i.name for i in quantised.input]
    assert [o.name for o in twin.output] == [o.name for o in quantised.output]
    # its large weights are the float32 ones in weights.bin: no second file
    assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in twin.initializer)
    assert sorted(p.name for p in int4_artifact.glob("*.bin")) == ["weights.bin"]


@pytest.mark.parametrize("mixed_steps", [True, False])
def test_a_wide_pass_runs_in_float32_and_a_narrow_one_quantised(
        int4_artifact: Path, tiny_checkpoint: Path, stdlib_text: str, mixed_steps: bool) -> None:
    """A prompt of WIDE tokens or more: the twin's logits are PyTorch's float32 ones; the
    same prompt with the twin off, and the decode steps after it, run on MatMulNBits.
    With mixed steps off the twin (engine_mixed.onnx's float32 build) serves the plain
    engine.onnx, its second group of rows left idle."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(int4_artifact / io.TOKENIZER_FILE))
    ids = tok.encode(stdlib_text[5000:8000], add_special_tokens=False).ids[:WIDE + 8]
    want = torch_logits(tiny_checkpoint, ids)[-1]  # (V,)

    wide = runner_for(int4_artifact, WIDE, mixed_steps)
    (slot,) = wide.reserve(1)
    (got,) = prefill(wide, [slot], [np.asarray(ids)])  # (1, V)
    twin_error = float(np.abs(got[0] - want).max())
    assert twin_error < 1e-3
    assert wide.float32_passes == 1
    for token in ids[:3]:  # one token a pass: the quantised graph
        decode(wide, [slot], np.asarray([token]))
    assert wide.float32_passes == 1

    narrow = runner_for(int4_artifact, 0, mixed_steps)
    (slot,) = narrow.reserve(1)
    (quantised,) = prefill(narrow, [slot], [np.asarray(ids)])
    assert narrow.float32_passes == 0
    assert float(np.abs(quantised[0] - want).max()) > 10 * twin_error

    short = ids[:WIDE - 1]  # one token short of the threshold: quantised as well
    (slot,) = wide.reserve(1)
    (below,) = prefill(wide, [slot], [np.asarray(short)])
    assert wide.float32_passes == 1
    np.testing.assert_allclose(
        below[0], prefill(narrow, narrow.reserve(1), [np.asarray(short)])[0][0], atol=1e-5)


def older(artifact: Path, tmp_path: Path, drop: tuple[str, ...] = ()) -> Path:
    """A copy of ``artifact`` whose manifest is of before the table of graphs (and of
    before the exporter recorded its threshold), without the files ``drop``."""
    import shutil

    old = Path(shutil.copytree(artifact, tmp_path / "artifact"))
    manifest = json.loads((old / io.MANIFEST_FILE).read_text("utf-8"))
    del manifest["graphs"]
    for name in drop:
        (old / name).unlink()
        del manifest["files"][name]
    (old / io.MANIFEST_FILE).write_text(json.dumps(manifest), "utf-8")
    return old


def test_an_artifact_without_float32_weights_runs_every_pass_quantised(
        int4_artifact: Path, tmp_path: Path) -> None:
    """An artifact exported before the float32 weights existed still serves."""
    runner = runner_for(older(int4_artifact, tmp_path, (ENGINE_FLOAT32_FILE,)), WIDE)
    assert runner.graphs == runner.graphs[:1] and runner.float32_pass_tokens is None
    (slot,) = runner.reserve(1)
    prefill(runner, [slot], [np.arange(3, 3 + WIDE + 4)])
    assert runner.float32_passes == 0


def test_a_manifest_without_the_table_serves_as_it_did(int4_artifact: Path,
                                                        tmp_path: Path) -> None:
    """The table of an older manifest is read from its files: the float32 graph from
    what export measured for int4 (512 tokens), and a pass that long runs on it (four
    prompts of the tiny model's whole context)."""
    runner = runner_for(older(int4_artifact, tmp_path), None)
    assert [g.file for g in runner.graphs] == [ENGINE_MIXED_FILE, ENGINE_FLOAT32_FILE]
    assert runner.float32_pass_tokens == 512
    assert runner.max_len == 128
    prefill(runner, runner.reserve(4), [np.arange(3, 3 + 128)] * 4)  # 512 tokens a pass
    assert runner.float32_passes == 1


def test_each_artifact_carries_its_own_threshold(int4_artifact: Path,
                                                  int8_artifact: Path) -> None:
    """Export records in the table from how many tokens the float32 weights pay (int4:
    512; 8-bit: 1,024; docs/engine.md); the runner takes it unless told."""
    for artifact, expected in ((int4_artifact, 512), (int8_artifact, 1024)):
        manifest = json.loads((artifact / io.MANIFEST_FILE).read_text("utf-8"))
        (long,) = [g for g in manifest["graphs"] if g["runs"] == "long passes"]
        assert long["file"] == ENGINE_FLOAT32_FILE and long["from_tokens"] == expected
        assert runner_for(artifact, None).float32_pass_tokens == expected
        assert runner_for(artifact, 64).float32_pass_tokens == 64
        assert runner_for(artifact, 0).float32_pass_tokens is None
