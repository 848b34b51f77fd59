"""Tokenizer round trips and the checkpoint format (bit-exact, no pickle, clear errors)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from model.checkpoint import (
    CheckpointError,
    CheckpointMeta,
    load_checkpoint,
    read_meta,
    save_checkpoint,
)
from model.tokenizer import build_char_tokenizer, decode, encode, special_ids, train_bpe_tokenizer

SAMPLES = [
    "你好世界",
    "Hello 👋 world 🌍🚀!\nSecond line\n\n\tindented",
    "混合 text with émoji 😀 and CJK 漢字\r\n",
]


def _corpus() -> list[str]:
    return ["The quick brown fox jumps over the lazy dog.\n" * 20, "你好世界 " * 10]


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_tokenizer_round_trip_chinese_emoji_newlines(kind):
    if kind == "char":
        tok = build_char_tokenizer([*_corpus(), *SAMPLES])
    else:
        tok = train_bpe_tokenizer(_corpus(), vocab_size=300)
    for text in SAMPLES:
        ids = encode(tok, text)
        assert decode(tok, ids) == text
        # Through the standard tokenizer.json, as the service will load it.
        reloaded = Tokenizer.from_str(tok.to_str())
        assert encode(reloaded, text) == ids
    assert special_ids(tok).to_dict() == {"pad_token_id": 0, "bos_token_id": 1,
                                          "eos_token_id": 2}


def test_char_tokenizer_is_one_token_per_character_and_unknowns_map_to_unk():
    tok = build_char_tokenizer(["你好世界"])
    assert encode(tok, "你好世界") == [4, 5, 6, 7]  # after <pad> <start> <end> <unk>
    assert encode(tok, "你X") == [4, 3]


def test_bpe_encodes_unseen_text_losslessly_via_bytes():
    tok = train_bpe_tokenizer(["aaaa bbbb"], vocab_size=270)
    text = "zebra 🦓 斑马"
    assert decode(tok, encode(tok, text)) == text


def _model_and_meta(make_model, tie: bool = False, position: str = "learned"):
    model = make_model(seed=3, tie_weights=tie, position=position)
    meta = CheckpointMeta(model=model.config,
                          tokenizer={"kind": "char", "pad_token_id": 0, "bos_token_id": 1,
                                     "eos_token_id": 2},
                          training={"steps": 5, "final_val_loss": 1.25})
    tok = build_char_tokenizer(["abc"])
    return model, meta, tok.to_str()


@pytest.mark.parametrize("tie,position", [(False, "learned"), (True, "sinusoidal")])
def test_checkpoint_round_trip_is_bit_exact(tmp_path, random_gpt, tie, position):
    model, meta, tok_json = _model_and_meta(random_gpt, tie, position)
    out = save_checkpoint(tmp_path / "ckpt", model, meta, tok_json, [{"step": 1, "loss": 2.0}])
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "metrics.jsonl", "model.safetensors", "tokenizer.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp leftovers
    loaded = load_checkpoint(out)
    assert loaded.meta.model == model.config
    assert loaded.meta.tokenizer == meta.tokenizer and loaded.meta.training == meta.training
    original, restored = model.state_dict(), loaded.model.state_dict()
    assert original.keys() == restored.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, restored[name]), name
    if tie:
        assert loaded.model.lm_head.weight.data_ptr() == loaded.model.tok_emb.weight.data_ptr()
    x = torch.randint(0, 37, (1, 9))
    assert torch.equal(model(x).logits, loaded.model(x).logits)


def test_checkpoint_is_readable_without_attnserve(tmp_path, random_gpt):
    """An independent reader needs only json and safetensors."""
    model, meta, tok_json = _model_and_meta(random_gpt)
    out = save_checkpoint(tmp_path / "ckpt", model, meta, tok_json)
    config = json.loads((out / "config.json").read_text())
    assert set(config) == {"format_version", "model", "tokenizer", "training"}
    d, v, layers = config["model"]["d_model"], config["model"]["vocab_size"], \
        config["model"]["n_layers"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        keys = set(handle.keys())
        assert tuple(handle.get_tensor("tok_emb.weight").shape) == (v, d)
        assert tuple(handle.get_tensor("blocks.0.attn.w_q.weight").shape) == (d, d)
        total = sum(handle.get_tensor(k).numel() for k in keys)
    assert {f"blocks.{layers - 1}.ffn.up.weight", "ln_f.weight", "lm_head.weight"} <= keys
    assert total == model.config.num_params_closed_form()
    Tokenizer.from_file(str(out / "tokenizer.json"))


@pytest.mark.parametrize("name", ["model.pt", "weights.pth", "model.pkl", "ckpt.bin"])
def test_refuses_pickle_files(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CheckpointError, match="pickle"):
        load_checkpoint(path)


def test_missing_and_corrupt_checkpoints_raise_checkpoint_error(tmp_path, random_gpt):
    model, meta, tok_json = _model_and_meta(random_gpt)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")

    def fresh(name: str) -> Path:
        return save_checkpoint(tmp_path / name, model, meta, tok_json)

    missing = fresh("missing")
    (missing / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"missing tokenizer\.json"):
        load_checkpoint(missing)

    truncated = fresh("truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError):
        load_checkpoint(truncated)

    bad_json = fresh("bad-json")
    (bad_json / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt"):
        read_meta(bad_json)

    mismatch = fresh("mismatch")
    raw = json.loads((mismatch / "config.json").read_text())
    raw["model"]["d_model"] = 64
    (mismatch / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="does not match"):
        load_checkpoint(mismatch)

    unknown_key = fresh("unknown-key")
    raw = json.loads((unknown_key / "config.json").read_text())
    raw["model"]["n_experts"] = 8
    (unknown_key / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="n_experts"):
        read_meta(unknown_key)
