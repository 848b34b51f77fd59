"""The adapter graphs (export/lora/adapter_graph.py): rows under different LoRA adapters and base
rows in one pass of engine_mixed_lora.onnx, against PyTorch with each adapter merged, for
float32 and int4 (MatMulNBits) graphs; attention_lora.onnx against the merged model's
attention.onnx; and the export writing, verifying and listing them."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from export.lora.adapter_check import (
    SLOTS,
    prefill,
    random_adapter,
    slot_inputs,
    token_mask,
    torch_adapter,
)
from export.lora.adapter_graph import build_adapter_graph, write_adapter_graphs
from export.onnx.engine_graph import build_engine_graph
from export.onnx.model_graphs import build_attention
from export.onnx.onnx_build import WeightsWriter
from export.quantize.weights import quantize_weights
from export.verify.parity import check_session
from model.architectures import architecture
from model.config import GPTConfig
from model.finetune.lora import merged_weights
from model.gpt import GPT
from service.contract import io_spec as io
from service.contract.adapter_spec import LORA_MASK, adapter_modules, lora_file
from service.contract.engine_spec import ENGINE_FILE, ENGINE_MIXED_FILE
from service.contract.graphs import GraphTable
from service.contract.manifest import load_manifest

LLAMA = dict(vocab_size=101, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=96,
             max_seq_len=64, position="rope", arch="llama", activation="silu",
             layer_norm_eps=1e-6)
FAMILIES = {"llama": {}, "qwen2": {"qkv_bias": True}, "qwen3": {"qk_norm": True},
            "phi3": {"fused_projections": True}}
T = 5  # tokens per prompt


def _int4_exact(gpt: GPT) -> None:
    """Every matrix's rows as int4 blocks of 32 would hold them exactly (codes k − 8 times
    2⁻⁵, each block spanning codes 0 to 15): MatMulNBits then multiplies by these very
    weights, so an int4 graph is held to the float32 rule."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in gpt.parameters():
            if p.dim() == 2 and p.shape[1] % 32 == 0:
                codes = torch.randint(0, 16, p.shape, generator=gen)
                codes[:, 0::32], codes[:, 1::32] = 0, 15
                p.copy_((codes - 8).float() / 32)


def _merged(gpt: GPT, lora: dict[str, tuple[np.ndarray, np.ndarray]]) -> GPT:
    merged = copy.deepcopy(gpt)
    merged.load_state_dict(merged_weights(gpt, torch_adapter(gpt.config, lora)), strict=False)
    return merged.eval()


def _model(family: str) -> GPT:
    torch.manual_seed(5)
    return GPT(GPTConfig(**LLAMA, **FAMILIES[family])).eval()  # type: ignore[arg-type]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("int4", [False, True], ids=["float32", "int4"])
@torch.no_grad()
def test_rows_under_two_adapters_and_a_base_row_equal_the_merged_models(
        family: str, int4: bool, tmp_path: Path) -> None:
    """engine_mixed_lora.onnx, both row groups fed: a base row and a row under adapter X
    (slot 1, rank 4) in the first group, a row under adapter Y (slot 2, rank 2, zero rows
    up to R = 4) in the chunk group; each adapted row equals PyTorch's model with its
    adapter merged (merged_weights), the base row the plain graph's; all-zero masks give
    the plain graph's logits for every row."""
    gpt = _model(family)
    if int4:
        _int4_exact(gpt)
    cfg = gpt.config
    with WeightsWriter(tmp_path) as weights:
        weights.add(ENGINE_MIXED_FILE, build_engine_graph(gpt, matmul_only=int4, mixed=True))
    base_file = ENGINE_MIXED_FILE
    if int4:
        base_file = "engine_mixed_int4.onnx"
        figures = quantize_weights(tmp_path / ENGINE_MIXED_FILE, tmp_path / base_file, "int4",
                                   flat=True, level=0)
        assert figures["quantized_matmuls"] > 0
    (written,) = write_adapter_graphs(tmp_path, cfg, [base_file])
    assert written.name == lora_file(base_file)
    model = onnx.load(str(written), load_external_data=False)
    inline = [t for t in model.graph.initializer
              if t.data_location != onnx.TensorProto.EXTERNAL and len(t.raw_data) > 1024]
    assert not inline  # no weight copied in: every one still in weights.bin
    if int4:
        products = sum(n.op_type == "MatMulNBits" for n in model.graph.node)
        assert products >= 5 * cfg.n_layers  # qkv, o, gate, up, down of each layer
    x, y = random_adapter(cfg, 1), random_adapter(cfg, 2, rank=2)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (3, T)).astype(np.int64)
    groups = [ids[:2], ids[2:]]
    lora, plain = check_session(written), check_session(tmp_path / base_file)
    assert adapter_modules([i.name for i in lora.get_inputs()]) == [
        t.module for t in architecture("llama").lora_targets(cfg)]
    buffers = slot_inputs(cfg, [x, y])
    mask = token_mask([None] * T + [0] * T + [1] * T, SLOTS)  # row-major, group by group
    got = np.concatenate(prefill(lora, cfg, groups, {**buffers, LORA_MASK: mask}))
    base = np.concatenate(prefill(plain, cfg, groups, {}))
    np.testing.assert_allclose(got[0], base[0], atol=1e-5, rtol=0)
    for row, lora_of in ((1, x), (2, y)):
        want = _merged(gpt, lora_of)(torch.from_numpy(ids[row:row + 1])).logits[0].numpy()
        np.testing.assert_allclose(got[row], want, atol=2e-4, rtol=0)
        assert np.abs(got[row] - base[row]).max() > 1e-2  # the adapter did move the row
    zero = np.concatenate(prefill(lora, cfg, groups, {
        **buffers, LORA_MASK: np.zeros_like(mask)}))
    np.testing.assert_allclose(zero, base, atol=1e-5, rtol=0)


@torch.no_grad()
def test_attention_lora_under_an_adapter_equals_the_merged_models_attention(
        tmp_path: Path) -> None:
    gpt = _model("qwen2")
    cfg = gpt.config
    lora = random_adapter(cfg, 4)
    merged = _merged(gpt, lora)
    (tmp_path / "base").mkdir()
    (tmp_path / "merged").mkdir()
    for directory, model in (("base", gpt), ("merged", merged)):
        with WeightsWriter(tmp_path / directory) as weights:
            weights.add(io.ATTENTION_FILE, build_attention(model))
    (written,) = write_adapter_graphs(tmp_path / "base", cfg, [io.ATTENTION_FILE])
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 7)).astype(np.int64)
    feed = {io.INPUT_IDS: ids, io.ATTENTION_MASK: np.ones_like(ids),
            io.POSITION_IDS: np.arange(7, dtype=np.int64)[None]}
    names = io.attention_output_names(cfg.n_layers)
    want = check_session(tmp_path / "merged" / io.ATTENTION_FILE).run(names, feed)
    got = check_session(written).run(names, {
        **feed, **slot_inputs(cfg, [None, lora]), LORA_MASK: token_mask([1] * 7, SLOTS)})
    for name, a, b in zip(names, got, want, strict=True):
        if name.endswith("weights"):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_a_graph_whose_projection_is_missing_is_refused_in_one_line() -> None:
    gpt = _model("llama")
    model = build_engine_graph(gpt)
    for node in model.graph.node:
        node.output[:] = [o.replace("l1.down", "l1.elsewhere") for o in node.output]
        node.input[:] = [i.replace("l1.down", "l1.elsewhere") for i in node.input]
    with pytest.raises(ValueError, match=r"^no adapter graph for this llama model: [^\n]*$"):
        build_adapter_graph(model, gpt.config)


@pytest.fixture(scope="module")
def engine_artifact(tiny_engine_artifact: Path) -> Path:
    return tiny_engine_artifact


def test_export_writes_verifies_and_lists_the_adapter_graphs(engine_artifact: Path) -> None:
    """The tiny GPT-2-style model (its ReLU MLP a FusedGemm, split for the update): the
    adapter graphs written beside the final graphs, in the manifest's files and table,
    checked against PyTorch with the adapter applied."""
    manifest = load_manifest(engine_artifact)
    lora_files = [lora_file(f) for f in (ENGINE_FILE, ENGINE_MIXED_FILE, io.ATTENTION_FILE)]
    assert set(lora_files) <= set(manifest.files)
    assert not list(engine_artifact.glob("*.check"))
    verification = manifest.verification
    figures = verification["adapters"][lora_file(ENGINE_MIXED_FILE)]
    assert figures["max_abs_diff"] <= figures["tolerance"]
    assert figures["base_rows_max_abs_diff"] <= 1e-5
    assert verification["adapters"][lora_file(io.ATTENTION_FILE)]["weights_max_abs_diff"] < 1e-4
    assert verification["adapters_served"] == {"files": lora_files}  # float32: checked above
    served = GraphTable.of(manifest).served(engine_graph=True, mixed_steps=True,
                                            on_cuda=False, adapters=True)
    assert [g.file for g in served] == [lora_file(ENGINE_MIXED_FILE)]
    rows = json.loads((engine_artifact / "manifest.json").read_text())["graphs"]
    assert [r["file"] for r in rows if r["adapters"]] == lora_files[:2]
