"""`attnserve import`: Hugging Face GPT-2 directories → our checkpoints, checked against
transformers' GPT2LMHeadModel (the independent reference), with nothing downloaded.

Models are random-weight GPT2LMHeadModels built from a GPT2Config and saved by
transformers itself; tokenizers are byte-level BPEs trained in the test.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from model.checkpoint import load_checkpoint, read_meta
from model.hf_import import import_hf_checkpoint
from service.cli import main as cli_main
from tests.hf_gpt2 import ENDOFTEXT, build_hf_model, load_hf_model, sample_texts

pytest.importorskip("transformers")

TOLERANCE = 1e-4


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-2 (tied, gelu_new) with tokenizer.json."""
    return build_hf_model(tmp_path_factory.mktemp("hf") / "gpt2-tiny")


def _hf_logits(hf: Any, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        if mask is None:
            return hf(ids).logits
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        return hf(ids, attention_mask=mask, position_ids=position_ids).logits


def _our_logits(ours: Any, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        return ours(ids, attention_mask=mask).logits


def _assert_same_logits(src: Path, ckpt: Path) -> None:
    """Plain and left-padded batches: our logits equal GPT2LMHeadModel's within 1e-4."""
    ours, hf = load_checkpoint(ckpt).model, load_hf_model(src)
    gen = torch.Generator().manual_seed(0)
    vocab = hf.config.vocab_size
    ids = torch.randint(0, vocab, (2, 24), generator=gen)
    assert (_our_logits(ours, ids) - _hf_logits(hf, ids)).abs().max() <= TOLERANCE
    mask = torch.ones_like(ids)
    mask[0, :9] = 0  # row 0 left-padded by 9
    real = mask.bool()
    diff = (_our_logits(ours, ids, mask) - _hf_logits(hf, ids, mask))[real]
    assert diff.abs().max() <= TOLERANCE


@pytest.mark.parametrize(("files", "overrides"), [
    ("tokenizer.json", {}),
    # Untied head, exact-erf GELU and a feed-forward width that is not 4 × n_embd.
    ("vocab+merges", {"tie_word_embeddings": False, "activation_function": "gelu",
                      "n_inner": 96}),
])
def test_import_matches_transformers_logits(tmp_path: Path, files: str,
                                             overrides: dict[str, Any]) -> None:
    src = build_hf_model(tmp_path / "hf", files, seed=1, **overrides)  # type: ignore[arg-type]
    hf_config = json.loads((src / "config.json").read_text("utf-8"))
    out = import_hf_checkpoint(src, tmp_path / "ckpt")
    carried = {"generation_config.json"} | (
        {"tokenizer_config.json"} if files == "vocab+merges" else set())  # for export
    assert {p.name for p in out.iterdir()} == {
        "config.json", "metrics.jsonl", "model.safetensors", "tokenizer.json", *carried}
    for name in carried:
        assert (out / name).read_bytes() == (src / name).read_bytes()
    meta = read_meta(out)
    eos = hf_config["eos_token_id"]
    assert eos == hf_config["vocab_size"] - 1  # <|endoftext|> is the last id, as in GPT-2
    assert meta.tokenizer == {"kind": "bpe", "pad_token_id": None, "bos_token_id": eos,
                              "eos_token_id": eos}
    cfg = meta.model
    assert (cfg.attn_bias, cfg.max_seq_len, cfg.tie_weights) == (
        True, hf_config["n_positions"], hf_config.get("tie_word_embeddings", True))
    assert cfg.activation == ("gelu" if overrides else "gelu_tanh")
    assert cfg.d_ff == overrides.get("n_inner", 4 * hf_config["n_embd"])
    _assert_same_logits(src, out)


def test_vocab_merges_tokenizer_equals_gpt2_tokenizer_fast(tmp_path: Path) -> None:
    """The tokenizer.json built from vocab.json + merges.txt encodes and decodes like
    transformers' GPT2TokenizerFast on the same files."""
    from tokenizers import Tokenizer
    from transformers import GPT2TokenizerFast

    src = build_hf_model(tmp_path / "hf", "vocab+merges")
    out = import_hf_checkpoint(src, tmp_path / "ckpt")
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    reference = GPT2TokenizerFast.from_pretrained(str(src))
    texts = [*sample_texts(20_000)[:5], "  leading spaces, trailing  ", "naïve café — 你好世界 🙂",
             f"one document{ENDOFTEXT}the next", "\n\n\tindented\r\n", ""]
    for text in texts:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == reference(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids)
    eos = reference.convert_tokens_to_ids(ENDOFTEXT)
    assert ours.token_to_id(ENDOFTEXT) == eos
    assert ours.get_added_tokens_decoder()[eos].special


def test_sharded_and_prefixless_weights_import_identically(tmp_path: Path, hf_dir: Path) -> None:
    """Sharded safetensors (an index.json) and GPT2Model-style names without the
    ``transformer.`` prefix, with the old causal-mask buffers, give the same checkpoint."""
    from safetensors.torch import load_file, save_file

    sharded = build_hf_model(tmp_path / "sharded", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert not (sharded / "model.safetensors").exists()
    _assert_same_logits(sharded, import_hf_checkpoint(sharded, tmp_path / "ckpt-sharded"))

    prefixless = tmp_path / "prefixless"
    shutil.copytree(hf_dir, prefixless)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    renamed = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    n_pos = json.loads((hf_dir / "config.json").read_text("utf-8"))["n_positions"]
    for i in range(json.loads((hf_dir / "config.json").read_text("utf-8"))["n_layer"]):
        renamed[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, n_pos, n_pos))
    save_file(renamed, str(prefixless / "model.safetensors"), metadata={"format": "pt"})
    a = load_file(str(import_hf_checkpoint(hf_dir, tmp_path / "a") / "model.safetensors"))
    b = load_file(str(import_hf_checkpoint(prefixless, tmp_path / "b") / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(("n_layer", "name"), [(12, "gpt2"), (6, "distilgpt2")])
def test_gpt2_family_shapes_match_transformers(tmp_path: Path, n_layer: int, name: str) -> None:
    """The real gpt2 (124 M) and distilgpt2 shapes: 50257 tokens, 1024 positions, 768 wide,
    12 heads. The tokenizer is smaller than the embedding, as a padded vocabulary is."""
    src = build_hf_model(tmp_path / name, vocab_size=50257, n_positions=1024, n_embd=768,
                         n_layer=n_layer, n_head=12, std=0.02)
    out = import_hf_checkpoint(src, tmp_path / "ckpt")
    cfg = read_meta(out).model
    assert (cfg.vocab_size, cfg.max_seq_len, cfg.d_model, cfg.n_heads, cfg.n_layers) == (
        50257, 1024, 768, 12, n_layer)
    ours, hf = load_checkpoint(out).model, load_hf_model(src)
    assert ours.num_params() == hf.num_parameters()
    ids = torch.randint(0, 50257, (1, 16), generator=torch.Generator().manual_seed(0))
    assert (_our_logits(ours, ids) - _hf_logits(hf, ids)).abs().max() <= TOLERANCE


def _refused(capsys: pytest.CaptureFixture[str], src: Path, out: Path) -> str:
    code = cli_main(["import", "--hf", str(src), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir()] == [p.name for p in out.parent.iterdir()
                                                      if not p.name.startswith(".")]
    return err


def test_pickled_weights_refused_with_a_way_to_safetensors(
        tmp_path: Path, hf_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "pickled"
    shutil.copytree(hf_dir, src)
    (src / "model.safetensors").unlink()
    # Not even a valid pickle: the importer must refuse by name, never open it.
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04 not for loading")
    (tmp_path / "out").mkdir()
    err = _refused(capsys, src, tmp_path / "out" / "ckpt")
    assert "pytorch_model.bin" in err and "safetensors" in err
    assert "save_pretrained" in err and "hf download" in err


@pytest.mark.parametrize(("change", "named"), [
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn"),
    ({"add_cross_attention": True}, "add_cross_attention"),
    ({"activation_function": "silu"}, "activation_function"),
    ({"model_type": "gpt_neo"}, "model_type"),
    ({"architectures": ["GPT2ForSequenceClassification"]}, "architectures"),
    ({"pruned_heads": {"0": [1]}}, "pruned_heads"),
    ({"n_inner": 100}, "c_fc.weight has shape"),  # config and weights disagree
    ({"n_layer": 3}, "missing"),
])
def test_unsupported_configs_refused_leaving_nothing(
        tmp_path: Path, hf_dir: Path, capsys: pytest.CaptureFixture[str],
        change: dict[str, Any], named: str) -> None:
    src = tmp_path / "hf"
    shutil.copytree(hf_dir, src)
    config = json.loads((src / "config.json").read_text("utf-8"))
    (src / "config.json").write_text(json.dumps({**config, **change}), "utf-8")
    (tmp_path / "out").mkdir()
    assert named in _refused(capsys, src, tmp_path / "out" / "ckpt")


def test_missing_tokenizer_and_non_empty_output_refused(
        tmp_path: Path, hf_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "hf"
    shutil.copytree(hf_dir, src)
    (src / "tokenizer.json").unlink()
    (tmp_path / "out").mkdir()
    assert "no tokenizer" in _refused(capsys, src, tmp_path / "out" / "ckpt")

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    assert cli_main(["import", "--hf", str(hf_dir), "--out", str(taken)]) == 2
    assert "--force" in capsys.readouterr().err
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
    assert cli_main(["import", "--hf", str(hf_dir), "--out", str(taken), "--force"]) == 0
    assert (taken / "model.safetensors").is_file() and not (taken / "keep.txt").exists()
