"""SentencePiece vocabularies in GGUF files (``tokenizer.ggml.model = llama``: Llama 2,
Mistral, Phi-3), rebuilt by model/gguf/vocab.py, against the ``sentencepiece`` library
itself (a BPE model with byte fallback trained here on the stdlib corpus, written to GGUF
keys the way llama.cpp's converter writes them) and, where llama.cpp's tools are built,
against llama.cpp's own tokenizer (llama-server's /tokenize) on the same file."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer

from model.gguf.vocab import build_tokenizer, read_vocab
from service.artifact.text import TextCodec
from tests.model.test_gguf_import import MIXED

SPM_TEXTS = [*[t for t in MIXED if "<|" not in t],  # special tokens are the other tests'
             "Hello world", " Hello  world ", "\n\nstarts with newlines", "ends with a space ",
             "naïve café ﬁ ligature ½ ℌ", "abc<0x41>def ▁ already escaped",
             "a" * 40 + " " + "b" * 3, "tabs\tand\u3000ideographic space"]


@pytest.fixture(scope="module")
def spm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A SentencePiece BPE model with byte fallback: no normalisation and no collapsing of
    spaces, as llama.cpp tokenizes (it does neither)."""
    import sentencepiece as sp

    from tests.hf_gpt2 import sample_texts

    root = tmp_path_factory.mktemp("spm")
    sp.SentencePieceTrainer.train(
        sentence_iterator=iter(sample_texts()), model_prefix=str(root / "m"), vocab_size=600,
        model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=False, character_coverage=1.0,
        bos_id=1, eos_id=2, unk_id=0, pad_id=-1, num_threads=1, minloglevel=2)
    return sp.SentencePieceProcessor(model_file=str(root / "m.model"))


def spm_metadata(model: Any) -> dict[str, Any]:
    """The tokenizer keys llama.cpp's converter writes for a SentencePiece model
    (convert_hf_to_gguf.py's _create_vocab_sentencepiece): pieces, scores, types."""
    tokens, scores, types = [], [], []
    for i in range(model.get_piece_size()):
        tokens.append(model.id_to_piece(i))
        scores.append(model.get_score(i))
        types.append(gguf.TokenType.UNKNOWN if model.is_unknown(i) else gguf.TokenType.CONTROL
                     if model.is_control(i) else gguf.TokenType.BYTE if model.is_byte(i)
                     else gguf.TokenType.NORMAL)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": [int(t) for t in types],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0}


@pytest.fixture(scope="module")
def ours(spm: Any) -> Tokenizer:
    return build_tokenizer(read_vocab(spm_metadata(spm), "test.gguf"))


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_ids_equal_sentencepieces(spm: Any, ours: Tokenizer, text: str) -> None:
    assert ours.encode(text, add_special_tokens=False).ids == spm.encode(text)
    # llama.cpp adds bos to a SentencePiece vocabulary unless the file says not to
    assert ours.encode(text).ids == [1, *spm.encode(text)]


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_text_decodes_back_and_streams_whole_characters(spm: Any, ours: Tokenizer,
                                                        text: str) -> None:
    ids = ours.encode(text, add_special_tokens=False).ids
    expected = text.replace("\u2581", " ")  # SentencePiece's own space reads as a space
    assert ours.decode(ids) == spm.decode(ids) == expected
    codec = TextCodec(ours)
    decoder = codec.decoder()
    pieces = [decoder.push(i) for i in ids]
    tail = decoder.flush()
    assert "".join(pieces) + tail == expected
    assert not any("\ufffd" in p for p in pieces)  # bytes of one character held together


def test_byte_fallback_spells_unseen_characters_as_bytes(spm: Any, ours: Tokenizer) -> None:
    ids = ours.encode("🤗", add_special_tokens=False).ids
    pieces = [ours.id_to_token(i) for i in ids]
    assert pieces[-4:] == ["<0xF0>", "<0x9F>", "<0xA4>", "<0x97>"]


def test_a_file_that_turns_the_space_prefix_off_gets_none(spm: Any) -> None:
    tok = build_tokenizer(read_vocab({**spm_metadata(spm),
                                      "tokenizer.ggml.add_space_prefix": False,
                                      "tokenizer.ggml.add_bos_token": False}, "t.gguf"))
    ids = tok.encode("Hello world").ids
    assert not tok.id_to_token(ids[0]).startswith("\u2581")  # no space before the first
    assert ids[-1] == spm.encode("Hello world")[-1]  # "▁world" as before
    assert tok.decode(ids) == "Hello world"


def test_scores_are_required(spm: Any) -> None:
    from model.hf_config import ImportRefused

    meta = spm_metadata(spm)
    del meta["tokenizer.ggml.scores"]
    with pytest.raises(ImportRefused, match=r"tokenizer\.ggml\.scores"):
        read_vocab(meta, "t.gguf")


def test_ids_equal_llamacpps_own_tokenizer(spm: Any, ours: Tokenizer, tmp_path: Path) -> None:
    """The same vocabulary in a GGUF file llama-server loads (a two-layer llama of random
    weights): its /tokenize gives our ids, bos included."""
    import httpx

    from benchmarks.lib.bound_port import wait_ready
    from benchmarks.llamacpp_tools import tool_path

    try:
        server = tool_path("llama-server")
    except FileNotFoundError as exc:  # not built on this machine (CI builds none)
        pytest.skip(str(exc))
    path = tmp_path / "spm.gguf"
    write_tiny_llama(path, spm_metadata(spm))
    port = _free_port()
    proc = subprocess.Popen([str(server), "-m", str(path), "--port", str(port), "--host",
                             "127.0.0.1", "-c", "256", "-t", "1"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, 60.0, interval=0.1, probe="/health")
        for text in SPM_TEXTS:
            theirs = httpx.post(f"http://127.0.0.1:{port}/tokenize",
                                json={"content": text, "add_special": True},
                                timeout=30).json()["tokens"]
            assert ours.encode(text).ids == theirs, text
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_tiny_llama(path: Path, tokenizer: dict[str, Any]) -> None:
    """A two-layer llama GGUF of random float32 weights carrying ``tokenizer``'s keys."""
    vocab, d, ff, heads = len(tokenizer["tokenizer.ggml.tokens"]), 64, 128, 4
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(d)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(d // heads)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokenizer["tokenizer.ggml.tokens"])
    writer.add_token_scores(tokenizer["tokenizer.ggml.scores"])
    writer.add_token_types(tokenizer["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, d), "output_norm.weight": (d,),
              "output.weight": (vocab, d)}
    for i in range(2):
        shapes.update({f"blk.{i}.attn_norm.weight": (d,), f"blk.{i}.ffn_norm.weight": (d,),
                       f"blk.{i}.attn_q.weight": (d, d), f"blk.{i}.attn_k.weight": (d, d),
                       f"blk.{i}.attn_v.weight": (d, d), f"blk.{i}.attn_output.weight": (d, d),
                       f"blk.{i}.ffn_gate.weight": (ff, d), f"blk.{i}.ffn_up.weight": (ff, d),
                       f"blk.{i}.ffn_down.weight": (d, ff)})
    for name, shape in shapes.items():
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32)
                          if len(shape) > 1 else np.ones(shape, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_import_writes_the_tokenizer_the_service_runs(spm: Any, tmp_path: Path) -> None:
    """`attnserve import --gguf` of a SentencePiece file: the checkpoint's tokenizer.json
    gives sentencepiece's ids (bos first, as llama.cpp adds it) and the service's codec
    decodes them back; bos and eos are special tokens."""
    from model.checkpoint import read_meta
    from model.gguf.to_checkpoint import import_gguf_checkpoint

    path = tmp_path / "spm.gguf"
    write_tiny_llama(path, spm_metadata(spm))
    ckpt = import_gguf_checkpoint(path, tmp_path / "ckpt")
    codec = TextCodec.from_file(ckpt / "tokenizer.json")
    for text in SPM_TEXTS:
        assert codec.encode(text) == [1, *spm.encode(text)]
    assert codec.special_ids >= {1, 2}
    assert codec.decode([1, *spm.encode("Hello world"), 2]) == "Hello world"
    meta = read_meta(ckpt)
    assert (meta.tokenizer["bos_token_id"], meta.tokenizer["eos_token_id"]) == (1, 2)
