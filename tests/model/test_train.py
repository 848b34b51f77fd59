"""Training through the Python API: learning, determinism, exact resume, checkpoint contents."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model.checkpoint import load_checkpoint, read_metrics
from model.train import TrainOptions, train
from model.train_state import TRAIN_STATE_FILE


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory: pytest.TempPathFactory, stdlib_text: str) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "stdlib-40k.txt"
    path.write_text(stdlib_text[:40_000], encoding="utf-8")
    return path


def _quick(out: Path, corpus: Path, **overrides) -> TrainOptions:
    """Tiny preset, char tokenizer, short windows: a few seconds at most."""
    fields = dict(out=str(out), data=str(corpus), preset="tiny", steps=8, tokenizer="char",
                  context=32, batch_size=8, eval_tokens=256, progress=False, verbose=False)
    fields.update(overrides)
    return TrainOptions(**fields)


def test_tiny_preset_beats_the_unigram_baseline(tmp_path, stdlib_text):
    corpus = tmp_path / "stdlib-300k.txt"
    corpus.write_text(stdlib_text[:300_000], encoding="utf-8")
    result = train(TrainOptions(out=str(tmp_path / "ckpt"), data=str(corpus), preset="tiny",
                                progress=False, verbose=False))
    assert result.steps == 100  # the tiny preset's schedule
    assert result.final_val_loss < result.unigram_val_loss - 0.3, result
    meta = load_checkpoint(result.out).meta
    assert meta.tokenizer == {"kind": "bpe", "pad_token_id": 0, "bos_token_id": 1,
                              "eos_token_id": 2}
    assert meta.model.vocab_size <= 512 and meta.model.d_model == 64
    training = meta.training
    for key in ("final_train_loss", "final_val_loss", "final_val_perplexity",
                "unigram_val_loss", "steps", "tokens_per_second", "wall_time_s", "seed"):
        assert key in training, key
    assert training["final_val_loss"] == result.final_val_loss
    metrics = read_metrics(result.out)
    assert [m["step"] for m in metrics] == list(range(1, 101))
    evals = [m for m in metrics if "val_loss" in m]
    assert evals[-1]["step"] == 100 and evals[0]["val_loss"] > evals[-1]["val_loss"]


def test_same_seed_same_weights_other_seed_other_weights(tmp_path, small_corpus):
    runs = {}
    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        result = train(_quick(tmp_path / name, small_corpus, seed=seed))
        runs[name] = load_file(str(result.out / "model.safetensors"))
    assert runs["a"].keys() == runs["b"].keys()
    assert all(torch.equal(runs["a"][k], runs["b"][k]) for k in runs["a"])
    assert not all(torch.equal(runs["a"][k], runs["c"][k]) for k in runs["a"])


def test_resume_ends_bit_identical_to_an_uninterrupted_run(tmp_path, small_corpus):
    halfway = tmp_path / "halfway"

    def keep_halfway(step: int, path: Path) -> None:
        if step == 6:
            shutil.copytree(path, halfway)

    straight = train(_quick(tmp_path / "straight", small_corpus, steps=12, eval_interval=6,
                            on_checkpoint=keep_halfway))
    assert json.loads((halfway / "config.json").read_text())["training"]["steps"] == 6
    assert (halfway / TRAIN_STATE_FILE).is_file()

    # A bare resume: preset, seed, batch size and learning rate come from the checkpoint.
    resumed = train(TrainOptions(out=str(halfway), data=str(small_corpus), steps=12,
                                 resume=True, eval_interval=6, eval_tokens=256,
                                 progress=False, verbose=False))
    assert resumed.steps == 12
    a = load_file(str(straight.out / "model.safetensors"))
    b = load_file(str(resumed.out / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.final_val_loss == straight.final_val_loss
    rows_a, rows_b = read_metrics(straight.out), read_metrics(resumed.out)
    assert [r["step"] for r in rows_b] == list(range(1, 13))
    assert [r["train_loss"] for r in rows_b] == [r["train_loss"] for r in rows_a]

    with pytest.raises(ValueError, match="already at step 12"):
        train(_quick(halfway, small_corpus, steps=12, resume=True))


def test_resume_without_optimizer_state_still_continues(tmp_path, small_corpus):
    first = train(_quick(tmp_path / "ckpt", small_corpus, steps=4))
    (first.out / TRAIN_STATE_FILE).unlink()
    before = load_file(str(first.out / "model.safetensors"))
    again = train(_quick(first.out, small_corpus, steps=6, resume=True))
    assert again.steps == 6
    after = load_file(str(again.out / "model.safetensors"))
    assert not all(torch.equal(before[k], after[k]) for k in before)


def test_time_budget_stops_training(tmp_path, small_corpus):
    result = train(_quick(tmp_path / "ckpt", small_corpus, steps=None, time_budget=0.5))
    assert result.steps >= 1
    assert load_checkpoint(result.out).meta.training["steps"] == result.steps
    assert "val_loss" in read_metrics(result.out)[-1]


def test_options_shape_the_model(tmp_path, small_corpus):
    result = train(_quick(tmp_path / "ckpt", small_corpus, steps=2, position="sinusoidal",
                          activation="gelu", tie_weights=True))
    config = load_checkpoint(result.out).meta.model
    assert (config.position, config.activation, config.tie_weights, config.max_seq_len) == (
        "sinusoidal", "gelu", True, 32)
    assert result.num_params == config.num_params_closed_form()


@pytest.mark.parametrize("overrides,message", [
    ({"preset": "huge"}, "unknown preset 'huge'"),
    ({"steps": 0}, "--steps must be positive"),
    ({"steps": -3}, "--steps must be positive"),
    ({"time_budget": 0.0}, "--time-budget must be positive"),
    ({"tokenizer": "bpe", "vocab_size": 100}, "too small for byte-level BPE"),
    ({"context": 100_000}, "corpus too short"),
])
def test_bad_options_raise_clear_value_errors(tmp_path, small_corpus, overrides, message):
    with pytest.raises(ValueError, match=message):
        train(_quick(tmp_path / "ckpt", small_corpus, **overrides))
    assert not (tmp_path / "ckpt").exists()
