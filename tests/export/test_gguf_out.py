"""`attnserve export --format gguf`: models and LoRA adapters as llama.cpp files.

The references are independent of the writer: gguf's own reader (the blocks of a file
written back are the file's, byte for byte; an outtype's tensors are gguf's quantiser's),
transformers' GGUF loader (a written file gives the model's logits), and, where its tools
are built (`python -m benchmarks.llamacpp_tools --build`; skipped otherwise), llama.cpp's
own llama-server: its greedy tokens on the written file, and with the written adapter over
the base file, are ours.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from export.gguf.model_file import export_gguf
from model.checkpoint import load_checkpoint
from tests.conftest import torch_threads
from tests.llamacpp_server import llama_server

Q = gguf.GGMLQuantizationType
PROMPTS = ([5, 17, 42, 99, 7, 3, 250, 31], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21])


def ours_greedy(model: Any, ids: list[int], n: int) -> list[int]:
    from model.sample import generate

    with torch.no_grad():
        return generate(model.eval(), torch.tensor([ids]), n, greedy=True
                        ).sequences[0, len(ids):].tolist()


def logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


def transformers_gguf(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()


def tensors(path: Path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


@pytest.fixture(scope="module")
def kquant(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A random Llama written as llama.cpp writes it (permuted Q/K rows) in K-quant and
    legacy blocks, and its import (which holds the file)."""
    from model.gguf.to_checkpoint import import_gguf_checkpoint
    from tests.gguf_files import write_gguf
    from tests.hf_llama import build_hf_model

    root = tmp_path_factory.mktemp("kquant")
    with torch_threads(1):
        build_hf_model(root / "hf", "llama", seed=5, hidden_size=256, intermediate_size=256)
        path = write_gguf(root / "hf", root / "source.gguf", types=(Q.Q4_K, Q.Q6_K, Q.Q8_0,
                                                                     Q.Q5_1))
        ckpt = import_gguf_checkpoint(path, root / "ckpt")
    return {"gguf": path, "ckpt": ckpt}


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """family → (transformers model, its import), built on first use."""
    from model.hf_import import import_hf_checkpoint
    from tests.hf_llama import build_hf_model

    # what llama.cpp computes: no window where its graph has none, its SmolLM3 rotary
    # pattern, Gemma's 1/√head_dim query scale
    overrides = {"phi3": {"sliding_window": None}, "mistral": {"sliding_window": None},
                 "gemma3": {"query_pre_attn_scalar": 32},
                 "smollm3": {"num_hidden_layers": 4, "no_rope_layers": [1, 1, 1, 0]}}
    built: dict[str, tuple[Any, Path]] = {}

    def get(family: str) -> tuple[Any, Path]:
        if family not in built:
            root = tmp_path_factory.mktemp(family)
            with torch_threads(1):
                hf = build_hf_model(root / "hf", family, seed=1, **overrides.get(family, {}))
                built[family] = (hf, import_hf_checkpoint(root / "hf", root / "ckpt"))
        return built[family]

    return get


def test_an_imported_file_written_back_keeps_its_blocks_byte_for_byte(kquant, tmp_path):
    out = export_gguf(kquant["ckpt"], tmp_path / "back.gguf")
    source, written = gguf.GGUFReader(kquant["gguf"]), gguf.GGUFReader(out)
    mine = {t.name: t for t in written.tensors}
    assert [t.name for t in source.tensors] == [t.name for t in written.tensors]
    for tensor in source.tensors:
        assert mine[tensor.name].tensor_type == tensor.tensor_type, tensor.name
        assert np.array_equal(np.asarray(mine[tensor.name].data), np.asarray(tensor.data))
    for key in source.fields:
        if key.startswith(("tokenizer.", "llama.")):
            assert written.fields[key].contents() == source.fields[key].contents(), key


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3", "mistral"])
def test_a_hugging_face_import_written_as_gguf_gives_transformers_logits(family, families,
                                                                        tmp_path):
    hf, ckpt = families(family)
    with torch_threads(1):
        # not named after the family: transformers' GGUF loader reads a llama file whose
        # general.name says "mistral" as a Mistral
        out = export_gguf(ckpt, tmp_path / "model.gguf")
        torch.testing.assert_close(logits(transformers_gguf(out), PROMPTS[0]),
                                   logits(hf, PROMPTS[0]), atol=1e-4, rtol=1e-4)


def own_checkpoint(root: Path, preset: str, kind: str = "bpe", **extra: Any) -> Path:
    """A model of ours of random weights (σ 0.3: clear greedy margins) with a BPE (or
    char) tokenizer trained on the test corpus; a context of 1,024 (transformers' GGUF
    loader gives GPT-2 that many positions whatever the file says)."""
    from dataclasses import replace

    from model.checkpoint import CheckpointMeta, save_checkpoint
    from model.config import config_from_preset
    from model.gpt import GPT
    from model.tokenizer import build_tokenizer, special_ids
    from tests.conftest import corpus_text

    tok = build_tokenizer(kind, [corpus_text()], vocab_size=300)  # type: ignore[arg-type]
    config = replace(config_from_preset(preset, vocab_size=tok.get_vocab_size(), **extra),
                     max_seq_len=1024)
    torch.manual_seed(0)
    model = GPT(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    meta = CheckpointMeta(config, {"kind": kind, **special_ids(tok).to_dict()})
    return save_checkpoint(root, model, meta, tok.to_str())


@pytest.mark.parametrize(("preset", "extra"), [
    ("tiny", {"activation": "gelu_tanh"}),
    ("tiny", {"activation": "gelu_tanh", "position": "sinusoidal", "attn_bias": True}),
    ("llama-tiny", {})])
def test_our_own_models_written_as_gguf_give_our_logits(preset, extra, tmp_path):
    """Our GPT (learned or sinusoidal positions written as the table, tanh GELU, zero
    attention biases where it has none: llama.cpp's gpt2 requires them) and a llama
    preset, read back by transformers' GGUF loader."""
    with torch_threads(1):
        ckpt = own_checkpoint(tmp_path / "ckpt", preset, **extra)
        out = export_gguf(ckpt, tmp_path / "model.gguf")
        torch.testing.assert_close(logits(transformers_gguf(out), PROMPTS[0]),
                                   logits(load_checkpoint(ckpt).model, PROMPTS[0]),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("outtype", ["q8_0", "q4_0"])
def test_an_outtype_is_ggufs_own_quantiser_over_the_float_file(outtype, families, tmp_path):
    """Every matrix is gguf's quantiser over the f32 file's, except the tied head (qwen2's
    token_embd here), which llama-quantize keeps at Q8_0 under a 4-bit type."""
    _, ckpt = families("qwen2")
    f32 = tensors(export_gguf(ckpt, tmp_path / "f32.gguf"))
    quantised = tensors(export_gguf(ckpt, tmp_path / "q.gguf", outtype=outtype))
    assert set(f32) == set(quantised) and "output.weight" not in f32
    for name, tensor in f32.items():
        data, got = np.asarray(tensor.data), quantised[name]
        kind = Q.Q8_0 if name == "token_embd.weight" else Q[outtype.upper()]
        if data.ndim == 1:
            assert got.tensor_type == Q.F32 and np.array_equal(np.asarray(got.data), data)
        elif data.shape[1] % 32 == 0:  # whole blocks of 32
            assert got.tensor_type == kind, name
            assert np.array_equal(np.asarray(got.data), gguf.quants.quantize(data, kind))
        else:  # ffn_down's rows are 56 wide: F16, as llama.cpp's converter falls back
            assert got.tensor_type == Q.F16, name
            assert np.array_equal(np.asarray(got.data), data.astype(np.float16))


def test_a_merged_finetune_of_a_gguf_import_gives_its_logits(kquant, tmp_path):
    """Written from its float weights (F32) over the base file's metadata."""
    from model.finetune.merge import merge

    adapter_dir = random_adapter(kquant["ckpt"], tmp_path / "adapter")
    with torch_threads(1):
        merged = merge(kquant["ckpt"], adapter_dir, tmp_path / "merged")
        out = export_gguf(merged, tmp_path / "merged.gguf")
        written = tensors(out)
        assert {t.tensor_type for t in written.values()} == {Q.F32}
        assert "output.weight" in written  # this Llama's head is its own
        torch.testing.assert_close(logits(transformers_gguf(out), PROMPTS[0]),
                                   logits(load_checkpoint(merged).model, PROMPTS[0]),
                                   atol=1e-4, rtol=1e-4)


def random_adapter(ckpt: Path, out: Path, seed: int = 3) -> Path:
    from model.finetune.lora import LoRASettings, attach
    from model.finetune.peft_format import adapter_files
    from model.finetune.tuned import load_base

    model, _, _ = load_base(ckpt, full=False)
    adapter = attach(model, LoRASettings(rank=4, alpha=8.0), seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lora in adapter.each():
            lora.lora_B.copy_(torch.randn(lora.lora_B.shape, generator=gen) * 0.05)
    out.mkdir()
    for name, content in adapter_files(adapter, str(ckpt)).items():
        (out / name).write_bytes(content)
    return out


def test_an_adapter_file_adds_its_update_in_the_base_files_layout(kquant, tmp_path):
    """llama.cpp's adapter: general.type adapter, alpha, <tensor>.lora_a / .lora_b; the base
    file's dequantised tensor plus alpha/r · lora_b · lora_a is, tensor for tensor, the
    merged checkpoint written as GGUF (which places our rows by the import's layout)."""
    from export.gguf.adapter_file import export_gguf_adapter
    from model.finetune.merge import merge

    adapter_dir = random_adapter(kquant["ckpt"], tmp_path / "adapter")
    with torch_threads(1):
        lora = export_gguf_adapter(adapter_dir, kquant["ckpt"], tmp_path / "lora.gguf")
        merged = export_gguf(merge(kquant["ckpt"], adapter_dir, tmp_path / "merged"),
                             tmp_path / "merged.gguf")
    reader = gguf.GGUFReader(lora)
    assert reader.fields["general.type"].contents() == "adapter"
    assert reader.fields["adapter.type"].contents() == "lora"
    assert reader.fields["general.architecture"].contents() == "llama"
    alpha = reader.fields["adapter.lora.alpha"].contents()
    assert alpha == pytest.approx(8.0)
    pairs = tensors(lora)
    base, merged_tensors = tensors(kquant["gguf"]), tensors(merged)
    names = {n.rsplit(".", 1)[0] for n in pairs}
    assert len(names) == 2 * 7 and "blk.0.attn_q.weight" in names
    for name in names:
        a = np.asarray(pairs[f"{name}.lora_a"].data)  # (r, in)
        b = np.asarray(pairs[f"{name}.lora_b"].data)  # (out, r)
        w = gguf.quants.dequantize(np.asarray(base[name].data), base[name].tensor_type)
        np.testing.assert_allclose(w + alpha / a.shape[0] * (b @ a),
                                   np.asarray(merged_tensors[name].data), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("preset", "kind", "extra", "reason"), [
    ("tiny", "bpe", {}, "tanh GELU"),  # ReLU
    ("tiny", "bpe", {"activation": "gelu"}, "tanh GELU"),  # the exact (erf) GELU
    ("llama-tiny", "char", {}, "tokenizer is not written")])
def test_what_llama_cpp_would_compute_otherwise_is_refused_and_nothing_written(
        preset, kind, extra, reason, tmp_path):
    ckpt = own_checkpoint(tmp_path / "ckpt", preset, kind, **extra)
    with pytest.raises(ValueError, match=reason):
        export_gguf(ckpt, tmp_path / "model.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_an_existing_file_is_kept_without_force(kquant, tmp_path):
    out = tmp_path / "keep.gguf"
    out.write_bytes(b"precious")
    with pytest.raises(ValueError, match="exists"):
        export_gguf(kquant["ckpt"], out)
    assert out.read_bytes() == b"precious"
    with pytest.raises(ValueError, match=r"\.gguf"):
        export_gguf(kquant["ckpt"], tmp_path / "model.bin")


# -- llama.cpp's own tools (skipped where they are not built) --------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "smollm3", "phi3", "gemma3"])
def test_llama_cpp_greedy_equals_ours_on_the_written_file(family, families, tmp_path):
    _, ckpt = families(family)
    with torch_threads(1):
        # llama.cpp keys per-token attributes off a name holding "phi3": not the family's
        out = export_gguf(ckpt, tmp_path / "model.gguf")
        model = load_checkpoint(ckpt).model
        with llama_server(out, log=tmp_path / "server.log") as server:
            for ids in PROMPTS:
                theirs = server.greedy(ids, 16)
                assert len(theirs) == 16 and ours_greedy(model, ids, 16) == theirs, ids


def test_llama_cpp_greedy_equals_ours_on_our_own_gpt(tmp_path):
    with torch_threads(1):
        ckpt = own_checkpoint(tmp_path / "ckpt", "tiny", activation="gelu_tanh")
        out = export_gguf(ckpt, tmp_path / "gpt.gguf")
        model = load_checkpoint(ckpt).model
        with llama_server(out) as server:
            for ids in PROMPTS:
                assert server.greedy(ids, 16) == ours_greedy(model, ids, 16), ids


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_llama_cpp_greedy_equals_ours_for_a_finetune_merged_and_as_an_adapter(
        family, families, tmp_path):
    """A fine-tune of a GGUF file (F32 blocks, so both engines multiply the same numbers;
    Phi-3: its LoRA over fused qkv_proj / gate_up_proj): merged and written as GGUF, and
    its adapter loaded by llama-server --lora over the base file."""
    from export.gguf.adapter_file import export_gguf_adapter
    from model.finetune.lora import wire
    from model.finetune.merge import merge
    from model.finetune.peft_format import read_adapter
    from model.finetune.tuned import load_base
    from model.gguf.to_checkpoint import import_gguf_checkpoint

    _, hf_ckpt = families(family)
    with torch_threads(1):
        base = export_gguf(hf_ckpt, tmp_path / "model.gguf")
        ckpt = import_gguf_checkpoint(base, tmp_path / "ckpt")
        adapter_dir = random_adapter(ckpt, tmp_path / "adapter")
        merged = export_gguf(merge(ckpt, adapter_dir, tmp_path / "merged"),
                             tmp_path / "merged.gguf")
        lora = export_gguf_adapter(adapter_dir, ckpt, tmp_path / "lora.gguf")
        tuned, meta, _ = load_base(ckpt, full=False)
        wire(tuned, read_adapter(adapter_dir, meta.model))
        expected = {tuple(ids): ours_greedy(tuned, ids, 16) for ids in PROMPTS}
        assert expected[tuple(PROMPTS[0])] != ours_greedy(load_checkpoint(ckpt).model,
                                                          PROMPTS[0], 16)  # it matters
        with llama_server(merged) as server:
            for ids in PROMPTS:
                assert server.greedy(ids, 16) == expected[tuple(ids)], ids
        with llama_server(base, lora=lora) as server:
            for ids in PROMPTS:
                assert server.greedy(ids, 16) == expected[tuple(ids)], ids
