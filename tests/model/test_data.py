"""Corpus building, document streams, batching and the unigram baseline."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch

from model import data
from model.data import (
    BatchSampler,
    encode_documents,
    eval_windows,
    read_documents,
    resolve_data_path,
    split_stream,
    stdlib_documents,
    unigram_cross_entropy,
)
from model.tokenizer import build_char_tokenizer, encode


def test_stdlib_corpus_is_deduplicated_english_docstrings_in_hash_order():
    docs = stdlib_documents()
    size = sum(len(d.encode("utf-8")) for d in docs)
    assert 800_000 <= size <= 3_000_000, size
    assert len(set(docs)) == len(docs)
    hashes = [hashlib.sha256(d.encode("utf-8")).hexdigest() for d in docs]
    assert hashes == sorted(hashes)  # deterministic order, independent of the file system
    assert all(len(d) >= data.MIN_DOC_CHARS and "<end>" not in d for d in docs)
    assert any(d.startswith("JSON (JavaScript Object Notation)") for d in docs)  # json module


def test_stdlib_walker_reads_source_without_importing_and_skips_noise(tmp_path):
    (tmp_path / "good.py").write_text(
        'raise SystemExit("importing me would exit")\n'
        'def helper():\n    """Compute a helpful value from the arguments given to it here."""\n'
        'def _private():\n    """A private helper that nobody should ever read about, really."""\n'
        'class Thing:\n    """A thing with a docstring long enough to be kept in the corpus."""\n'
        '    def method(self):\n        """Compute a helpful value from the arguments given to'
        ' it here."""\n')
    (tmp_path / "_hidden.py").write_text('"""Private module docstring that is long enough to '
                                         'count but must be skipped."""\n')
    (tmp_path / "idlelib").mkdir()
    (tmp_path / "idlelib" / "x.py").write_text('"""GUI noise docstring that is long enough to '
                                               'count but must be skipped."""\n')
    (tmp_path / "broken.py").write_text("def (:\n")
    docs = stdlib_documents(tmp_path)
    assert sorted(docs) == sorted([
        "Compute a helpful value from the arguments given to it here.",
        "A thing with a docstring long enough to be kept in the corpus."])


def test_stdlib_corpus_is_cached_atomically(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setenv("ATTNSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(data, "stdlib_documents", lambda: calls.append(1) or ["one doc",
                                                                               "two doc"])
    path = resolve_data_path("stdlib")
    assert path.parent == tmp_path / "cache" and calls == [1]
    assert read_documents(path) == ["one doc", "two doc"]
    assert resolve_data_path("stdlib") == path and calls == [1]  # built once
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp files left


def test_documents_are_split_at_end_lines_and_end_with_eos(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("first doc\nline two\n<end>\nsecond\r\n<end>\n\n<end>\nthird\n",
                      encoding="utf-8")
    docs = read_documents(corpus)
    assert docs == ["first doc\nline two", "second", "third"]
    tok = build_char_tokenizer(docs)
    stream = encode_documents(tok, docs, eos_id=2)
    expected = [*encode(tok, docs[0]), 2, *encode(tok, docs[1]), 2, *encode(tok, docs[2]), 2]
    assert stream == expected


def test_bad_corpus_files_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_data_path(str(tmp_path / "missing.txt"))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        resolve_data_path(str(empty))
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("café au lait".encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8"):
        read_documents(latin)
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n<end>\n  \n")
    with pytest.raises(ValueError, match="no text"):
        read_documents(blank)
    with pytest.raises(ValueError, match="corpus too short: 20 tokens"):
        split_stream(list(range(20)), context=16)


def test_split_keeps_the_tail_for_validation():
    splits = split_stream(list(range(1000)), context=8)
    assert splits.train.tolist() == list(range(900))
    assert splits.val.tolist() == list(range(900, 1000))


def test_batches_are_contiguous_reproducible_and_differ_by_rank():
    ids = torch.arange(500)
    sampler = BatchSampler(ids, context=16, batch_size=4, seed=3)
    x, y = sampler.batch(7)
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(y, x + 1)  # targets are the inputs shifted by one token
    assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones(4, 15, dtype=torch.long))
    again = BatchSampler(ids, context=16, batch_size=4, seed=3)
    assert torch.equal(again.batch(7)[0], x)  # a pure function of (seed, rank, step)
    assert not torch.equal(sampler.batch(8)[0], x)
    other_rank = BatchSampler(ids, context=16, batch_size=4, seed=3, rank=1)
    assert not torch.equal(other_rank.batch(7)[0], x)


def test_eval_windows_are_non_overlapping_and_capped():
    x, y = eval_windows(torch.arange(100), context=10, max_tokens=35)
    assert x.shape == (3, 10) and x[1, 0].item() == 10
    assert torch.equal(y, x + 1)


def test_unigram_cross_entropy_by_hand():
    # Train counts: token 0 x3, token 1 x1; vocab 3 -> add-one: p = 4/7, 2/7, 1/7.
    train = torch.tensor([0, 0, 0, 1])
    targets = torch.tensor([0, 1, 2, 0])
    expected = -(2 * math.log(4 / 7) + math.log(2 / 7) + math.log(1 / 7)) / 4
    assert unigram_cross_entropy(train, targets, vocab_size=3) == pytest.approx(expected)


def test_char_stream_of_a_real_file(tmp_path: Path, stdlib_text: str):
    corpus = tmp_path / "s.txt"
    corpus.write_text(stdlib_text[:5000], encoding="utf-8")
    docs = read_documents(corpus)
    assert len(docs) == 1  # no <end> lines: the whole file is one document
    tok = build_char_tokenizer(docs)
    stream = encode_documents(tok, docs, eos_id=2)
    assert len(stream) == len(docs[0]) + 1


def test_reflow_joins_wrapped_prose_and_keeps_structured_blocks():
    doc = ("Return the sum of a\nand b, wrapped at\nseventy columns.\n\n"
           "Example:\n>>> add(1,\n...     2)\n3\n\n"
           "Arguments:\n    a -- first\n    b -- second\n\n"
           "- one item\n- another item")
    assert data.reflow(doc) == (
        "Return the sum of a and b, wrapped at seventy columns.\n\n"
        "Example:\n>>> add(1,\n...     2)\n3\n\n"
        "Arguments:\n    a -- first\n    b -- second\n\n"
        "- one item\n- another item")
