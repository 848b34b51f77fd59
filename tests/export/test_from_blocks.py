"""`--quantize gguf` of a checkpoint that holds its GGUF file, built from the blocks
(export/from_blocks.py): no weight matrix in float32 whole, PyTorch's side layer by layer.

The reference is the general export of the same file imported with ``--float32``: float32
graphs verified against the whole PyTorch model, each weight swapped for the file's blocks
only after the blocks were checked to dequantise to it (export/gguf/blocks.py). Both
exports must write the same graphs and weights.bin, byte for byte. The layer-by-layer
reference is checked against the whole float32 model's forward on the same sequences, and
shown to fail an export whose layer differs from the file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from export.from_blocks import builds_from_blocks
from export.onnx.onnx_build import Graph, StandIn, WeightsWriter, f32, is_placeholder, make_model
from export.to_onnx import export_artifact
from export.verify.engine_parity import EngineDecoder
from export.verify.layerwise import LayerwiseReference
from export.verify.parity import VerificationError, check_prompts, decoder_for
from model.checkpoint import load_checkpoint
from model.gguf.codes import DIRECT
from model.gguf.to_checkpoint import import_gguf_checkpoint
from service.contract.engine_spec import ENGINE_FILE, ENGINE_MIXED_FILE
from tests.conftest import torch_threads
from tests.export.test_gguf_blocks import CASES, write_file

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

GRAPHS = ("model.onnx", "attention.onnx", ENGINE_FILE, ENGINE_MIXED_FILE, "weights.bin")


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def kquants(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A Q4_K | Q6_K file (as Q4_K_M mixes them) and its checkpoint holding it."""
    root = tmp_path_factory.mktemp("kquants")
    path = write_file(root, CASES["kquants"])
    return path, import_gguf_checkpoint(path, root / "ckpt")


@pytest.mark.parametrize("case", ["kquants", "qwen2-untied", "gpt2", "q8_0"])
def test_the_artifact_is_the_float32_checkpoints_byte_for_byte(
        case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tied and untied heads, GPT-2's fused Q|K|V and quantised position table, 8-bit and
    K-quant blocks: the same graphs and weights.bin as the general export writes (the
    K-quants with the rewrites on two threads, as a model of over 50 M parameters has
    them)."""
    if case == "kquants":
        monkeypatch.setattr("export.verify.parity.check_threads", lambda gpt: 2)
    path = write_file(tmp_path, CASES[case])
    held = import_gguf_checkpoint(path, tmp_path / "held")
    float32 = import_gguf_checkpoint(path, tmp_path / "float32", float32=True)
    assert builds_from_blocks(held, "gguf", False)
    assert not builds_from_blocks(float32, "gguf", False)
    assert not builds_from_blocks(held, "gguf", True)  # a float32 twin needs the weights
    assert not builds_from_blocks(held, "int4", False)
    ours = export_artifact(held, tmp_path / "ours", quantize="gguf", engine_graph=True)
    general = export_artifact(float32, tmp_path / "general", quantize="gguf",
                              engine_graph=True, verify=False)
    for name in GRAPHS:
        assert (ours / name).read_bytes() == (general / name).read_bytes(), name
    manifest = json.loads((ours / "manifest.json").read_text("utf-8"))["verification"]
    assert manifest["passed"] and "layer by layer" in manifest["reference"]
    for key in ("engine", "engine_mixed"):
        assert manifest[key]["greedy_equal"] and manifest[key]["in_place"]
    judged = manifest["engine_quantized"]  # the served graph, against float activations
    assert judged["token_agreement"] >= judged["agreement_target"]
    assert manifest["quantized"]["judged_on"] == ENGINE_FILE
    assert not [p.name for p in ours.iterdir() if p.name.startswith(".")]


def test_kept_matrices_are_never_loaded(kquants: tuple[Path, Path]) -> None:
    """Loaded for the export, every projection, the embedding and the head stay on the meta
    device (no storage); the norms hold the file's values."""
    ckpt = load_checkpoint(kquants[1], leave=frozenset(DIRECT))
    meta = {n for n, p in ckpt.model.named_parameters() if p.is_meta}
    assert "tok_emb.weight" in meta and "blocks.0.attn.w_q.weight" in meta
    assert "blocks.1.ffn.down.weight" in meta
    assert not any("ln" in n or "norm" in n for n in meta)
    assert isinstance(f32(ckpt.model.tok_emb.weight), StandIn)
    whole = load_checkpoint(kquants[1]).model
    assert torch.equal(ckpt.model.blocks[0].ln_1.weight, whole.blocks[0].ln_1.weight)


def test_layer_by_layer_logits_are_the_whole_models(kquants: tuple[Path, Path],
                                                    tmp_path: Path) -> None:
    """The reference's logits, greedy continuations and attention intermediates equal the
    whole float32 model's forward on the same inputs; every layer is back on the meta
    device afterwards."""
    ckpt_dir = kquants[1]
    art = export_artifact(ckpt_dir, tmp_path / "art", quantize="gguf", engine_graph=False,
                          activations="float")  # model.onnx at float activations
    ckpt = load_checkpoint(ckpt_dir, leave=frozenset(DIRECT))
    gpt = ckpt.model
    prompts = check_prompts(gpt.config)
    reference = LayerwiseReference(
        gpt, ckpt.held, lambda: decoder_for(art / "model.onnx", gpt, "float32")).prepare(prompts)
    whole = load_checkpoint(ckpt_dir).model
    with torch.no_grad():
        want = whole(torch.from_numpy(prompts.prefill)).logits.numpy()
        np.testing.assert_allclose(reference.logits(prompts.prefill), want, atol=1e-5, rtol=0)
        for prompt in prompts.decode:
            tokens, logits = reference.greedy(prompt, 64)
            assert tokens[:len(prompt)] == prompt and len(tokens) == len(prompt) + 64
            full = whole(torch.tensor([tokens[:-1]])).logits[0].numpy()
            np.testing.assert_allclose(logits, full, atol=1e-5, rtol=0)
            # the graph chose each continuation token: it is the reference's argmax but
            # where the two are within rounding of a tie
            chosen = np.asarray(tokens[len(prompt):])
            agree = full[len(prompt) - 1:].argmax(-1) == chosen
            assert agree.mean() >= 0.95
    inter = reference.intermediates(prompts.attention)
    from export.verify.parity import left_pad

    ids, mask, pos = (torch.from_numpy(a) for a in left_pad(prompts.attention))
    with torch.no_grad():
        out = whole(ids, attention_mask=mask, position_ids=pos, return_intermediates=True)
    assert out.intermediates is not None and len(inter) == len(out.intermediates)
    for mine, theirs in zip(inter, out.intermediates, strict=True):
        torch.testing.assert_close(mine.weights, theirs.weights, atol=1e-6, rtol=0)
    assert all(p.is_meta for n, p in gpt.named_parameters() if "attn.w_" in n or "ffn" in n)
    with pytest.raises(KeyError, match="prepared"):
        reference.greedy(prompts.decode[0], 3)


def test_a_layer_that_differs_from_the_file_fails_the_export(
        kquants: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PyTorch's side really is checked: one layer's down projection scaled in the reference
    (as a wrong tensor mapping would change it) makes the export refuse, and nothing is
    written."""
    from model.gguf.reader import HeldWeights

    real = HeldWeights.state

    def shifted(self: HeldWeights, prefix: str = "", *args: object, **kwargs: object
                ) -> dict[str, torch.Tensor]:
        out = real(self, prefix, *args, **kwargs)  # type: ignore[arg-type]
        return {k: v * 1.5 if k == "blocks.1.ffn.down.weight" else v for k, v in out.items()}

    monkeypatch.setattr(HeldWeights, "state", shifted)
    out = tmp_path / "art"
    with pytest.raises(VerificationError, match="differ"):
        export_artifact(kquants[1], out, quantize="gguf", engine_graph=True)
    assert not out.exists()


def test_a_placeholder_never_reaches_an_artifact(tmp_path: Path) -> None:
    """A weight the blocks did not replace cannot be saved into the final weights.bin."""
    g = Graph()
    g.one("MatMul", ["x", g.const("w", f32(torch.empty(4, 8, device="meta")).T)], "y")
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 8])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])
    model = make_model(g, "g", [x], [y], 18, "")
    assert is_placeholder(model.graph.initializer[0])
    assert list(model.graph.initializer[0].dims) == [8, 4]
    with WeightsWriter(tmp_path) as first:  # while graphs are being built: passed through
        first.add("g.onnx", model)
    with pytest.raises(ValueError, match="never built"), \
            WeightsWriter(tmp_path, base=tmp_path) as final:
        final.add("g.onnx", onnx.load(str(tmp_path / "g.onnx"), load_external_data=False))


def test_engine_graph_at_float_activations_answers_as_the_whole_model(
        kquants: tuple[Path, Path], tmp_path: Path) -> None:
    """The served engine graph at float activations (the float32 model's arithmetic on the
    file's exact weights) gives the whole PyTorch model's logits."""
    art = export_artifact(kquants[1], tmp_path / "art", quantize="gguf", engine_graph=True,
                          mixed_steps=False, activations="float")
    whole = load_checkpoint(kquants[1]).model
    prompt = np.arange(3, 19, dtype=np.int64)[None]  # (1, 16)
    dec = EngineDecoder(art / ENGINE_FILE, whole)
    logits, _ = dec(prompt, np.ones_like(prompt), np.arange(16)[None], dec.empty_past(1))
    with torch.no_grad():
        want = whole(torch.from_numpy(prompt)).logits.numpy()
    np.testing.assert_allclose(logits, want, atol=1e-4, rtol=0)


def test_without_engine_graphs_model_onnx_is_judged(kquants: tuple[Path, Path],
                                                   tmp_path: Path) -> None:
    """No engine graph: model.onnx is the served graph, judged at int8 activations against
    its float-activation self, and no checked copy is left behind."""
    art = export_artifact(kquants[1], tmp_path / "art", quantize="gguf")
    verification = json.loads((art / "manifest.json").read_text("utf-8"))["verification"]
    judged = verification["quantized"]
    assert judged["judged_on"] == "model.onnx"
    assert judged["token_agreement"] >= judged["agreement_target"]
    assert judged["perplexity_relative_change"] < 0.05
    assert sorted(p.name for p in art.glob("*.onnx")) == ["attention.onnx",
                                                          "attention_lora.onnx", "model.onnx"]
