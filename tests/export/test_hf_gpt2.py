"""Imported GPT-2 through every export: the ONNX graphs against transformers'
GPT2LMHeadModel (logits and output_attentions), int8 and float16 artifacts, and the
Hugging Face round trip HF → ours → HF with bit-identical tensors.

The reference is transformers itself; the ONNX graphs are driven by plain
onnxruntime sessions by their contract names (service/contract/io_spec.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch

from export.to_hf import export_hf
from model.hf_import import import_hf_checkpoint
from service.contract import io_spec as io
from service.contract.manifest import verify_manifest
from tests.hf_gpt2 import build_hf_model, load_hf_model

pytest.importorskip("transformers")

TOLERANCE = 1e-4


def _session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _hf(hf: Any, ids: np.ndarray, mask: np.ndarray, **kwargs: Any) -> Any:
    t_ids, t_mask = torch.from_numpy(ids), torch.from_numpy(mask)
    with torch.no_grad():
        return hf(t_ids, attention_mask=t_mask,
                  position_ids=(t_mask.cumsum(-1) - 1).clamp(min=0), **kwargs)


def _left_padded(prompts: list[list[int]], fill: int) -> tuple[np.ndarray, np.ndarray]:
    width = max(map(len, prompts))
    ids = np.full((len(prompts), width), fill, np.int64)
    mask = np.zeros((len(prompts), width), np.int64)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = p, 1
    return ids, mask


def _decode_against_transformers(model_path: Path, hf: Any, cfg: io.ArtifactConfig,
                                 steps: int = 6) -> tuple[float, float]:
    """Left-padded prefill of two prompts, then greedy decode through the KV cache; the
    worst |ORT − transformers| over every real position of every call, and the fraction
    of those positions where both pick the same next token."""
    session = _session(model_path)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (11, 4)]
    ids, mask = _left_padded(prompts, cfg.fill_token_id)
    kv = np.dtype(cfg.kv_dtype)
    past = {n: np.zeros((2, cfg.n_heads, 0, cfg.head_dim), kv)
            for n in io.past_names(cfg.n_layers)}
    feed_ids, worst, same, total = ids, 0.0, 0, 0
    for _ in range(steps):
        pos = ((mask.cumsum(-1) - 1).clip(min=0))[:, -feed_ids.shape[1]:]
        logits, *present = session.run(None, {io.INPUT_IDS: feed_ids, io.ATTENTION_MASK: mask,
                                              io.POSITION_IDS: pos, **past})
        ref = _hf(hf, ids, mask).logits.numpy()[:, -feed_ids.shape[1]:]  # (B, T, V)
        real = mask[:, -feed_ids.shape[1]:].astype(bool)
        worst = max(worst, float(np.abs(logits - ref)[real].max()))
        same += int((logits.argmax(-1) == ref.argmax(-1))[real].sum())
        total += int(real.sum())
        nxt = ref[:, -1].argmax(-1)[:, None]  # (B, 1): transformers' greedy choice
        past = dict(zip(io.past_names(cfg.n_layers), present, strict=True))
        ids, feed_ids = np.concatenate([ids, nxt], 1), nxt
        mask = np.concatenate([mask, np.ones_like(nxt)], 1)
    return worst, same / total


def test_model_onnx_logits_match_transformers(served_gpt2: Any, gpt2_artifact: Path) -> None:
    cfg = io.ArtifactConfig.load(gpt2_artifact)
    assert (cfg.n_layers, cfg.n_heads, cfg.pad_token_id) == (12, 12, None)
    assert cfg.bos_token_id == cfg.eos_token_id == cfg.vocab_size - 1
    hf = load_hf_model(served_gpt2.hf_dir)
    worst, _ = _decode_against_transformers(gpt2_artifact / io.MODEL_FILE, hf, cfg)
    assert worst <= TOLERANCE
    manifest = verify_manifest(gpt2_artifact)
    assert "engine.onnx" in manifest.files
    assert manifest.verification["engine"]["max_abs_diff"] <= TOLERANCE


def test_attention_onnx_equals_output_attentions(served_gpt2: Any, gpt2_artifact: Path) -> None:
    cfg = io.ArtifactConfig.load(gpt2_artifact)
    hf = load_hf_model(served_gpt2.hf_dir)
    rng = np.random.default_rng(1)
    ids, mask = _left_padded([rng.integers(0, cfg.vocab_size, n).tolist() for n in (9, 5)],
                             cfg.fill_token_id)
    pos = (mask.cumsum(-1) - 1).clip(min=0)
    names = [io.attention_output_name(i, "weights") for i in range(cfg.n_layers)]
    ours = _session(gpt2_artifact / io.ATTENTION_FILE).run(
        names, {io.INPUT_IDS: ids, io.ATTENTION_MASK: mask, io.POSITION_IDS: pos})
    reference = _hf(hf, ids, mask, output_attentions=True).attentions  # per layer (B, nh, T, T)
    assert len(ours) == len(reference) == 12
    for layer, (a, b) in enumerate(zip(ours, reference, strict=True)):
        assert a.shape == (2, 12, ids.shape[1], ids.shape[1])
        # Rows of padding queries are discarded by both; compare the real queries.
        real = mask.astype(bool)
        np.testing.assert_allclose(a.transpose(0, 2, 1, 3)[real], b.numpy().transpose(
            0, 2, 1, 3)[real], atol=1e-5, err_msg=f"layer {layer}")


@pytest.mark.parametrize(("files", "overrides"), [
    ("tokenizer.json", {}),
    ("vocab+merges", {"tie_word_embeddings": False, "activation_function": "gelu",
                      "n_inner": 96}),
])
def test_hf_round_trip_is_bit_identical(tmp_path: Path, files: str,
                                        overrides: dict[str, Any]) -> None:
    """HF → `attnserve import` → `export --format hf`: the same tensor names, dtypes and
    bits, a config transformers reads as the same network, and the same tokenizer."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    src = build_hf_model(tmp_path / "hf", files, seed=5, **overrides)  # type: ignore[arg-type]
    ckpt = import_hf_checkpoint(src, tmp_path / "ckpt")
    back = export_hf(ckpt, tmp_path / "back")
    a = load_file(str(src / "model.safetensors"))
    b = load_file(str(back / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    original = json.loads((src / "config.json").read_text("utf-8"))
    copied = json.loads((back / "config.json").read_text("utf-8"))
    for key in ("n_embd", "n_layer", "n_head", "n_positions", "vocab_size",
                "layer_norm_epsilon", "bos_token_id", "eos_token_id"):
        assert copied[key] == original[key], key
    assert copied["activation_function"] == original["activation_function"]
    assert copied["n_inner"] == (original["n_inner"] or 4 * original["n_embd"])
    assert copied["tie_word_embeddings"] == original.get("tie_word_embeddings", True)
    assert copied["pad_token_id"] is None
    ids = torch.randint(0, original["vocab_size"], (1, 12),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(load_hf_model(src)(ids).logits, load_hf_model(back)(ids).logits)
    text = "Return the value of x, naïvely 🙂"
    tok_src, tok_back = AutoTokenizer.from_pretrained(str(src)), AutoTokenizer.from_pretrained(
        str(back))
    assert tok_back(text)["input_ids"] == tok_src(text)["input_ids"]
    assert (tok_back.eos_token, tok_back.bos_token, tok_back.pad_token) == (
        "<|endoftext|>", "<|endoftext|>", None)


def test_int8_and_float16_artifacts_of_an_imported_gpt2(tmp_path: Path) -> None:
    """Both exports verify against PyTorch themselves; here their graphs also track
    transformers: float16 KV cache within 1e-2; int8 (weights and activations rounded, so
    judged by next-token choices) agreeing with float32 on ≥ 90% of greedy steps, and
    with transformers' next token at ≥ 80% of all positions of a ragged batch."""
    from export.to_onnx import export_artifact

    src = build_hf_model(tmp_path / "hf", seed=7)
    ckpt = import_hf_checkpoint(src, tmp_path / "ckpt")
    hf = load_hf_model(src)
    half = export_artifact(ckpt, tmp_path / "fp16", dtype="float16")
    cfg = io.ArtifactConfig.load(half)
    assert cfg.kv_dtype == "float16"
    assert _decode_against_transformers(half / io.MODEL_FILE, hf, cfg)[0] <= 1e-2
    int8 = export_artifact(ckpt, tmp_path / "int8", quantize="int8")
    figures = verify_manifest(int8).verification["quantized"]
    assert figures["token_agreement"] >= 0.9, figures
    _, agreement = _decode_against_transformers(int8 / io.MODEL_FILE, hf,
                                                io.ArtifactConfig.load(int8))
    assert agreement >= 0.8, agreement
