"""`attnserve eval` against independent references.

The reference is transformers' own sliding-window perplexity recipe ("Perplexity of
fixed-length models": labels -100 outside the window's new tokens), rewritten here: for our
GPT a full-sequence log-softmax per window, for an imported Llama the transformers model's
own loss. The code under test has to reproduce it from the ONNX artifact and from the
PyTorch checkpoint, over token ids the test encodes itself.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer

from export.verify.evaluate import (
    artifact_backend,
    checkpoint_backend,
    evaluate,
    load_text,
    plan_windows,
)
from model.checkpoint import load_checkpoint
from service.cli import main
from tests.hf_llama import load_hf_model

Nll = Callable[[torch.Tensor, torch.Tensor], tuple[float, int]]  # window ids, labels → sum, n


def sliding_nll(ids: list[int], window: int, stride: int, window_nll: Nll) -> tuple[float, int]:
    """transformers' recipe: each window's labels are its tokens past the last window's end."""
    x, total, count, prev_end = torch.tensor(ids), 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        labels = x[begin:end].clone()
        labels[:-(end - prev_end)] = -100
        nll, n = window_nll(x[begin:end], labels)
        total, count, prev_end = total + nll, count + n, end
        if end == len(ids):
            break
    return total, count


def gpt_window_nll(gpt: Any) -> Nll:
    def nll(x: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
        with torch.no_grad():
            logp = torch.log_softmax(gpt(x[None]).logits[0].double(), -1)  # (T, V)
        target, keep = labels[1:], labels[1:] != -100  # position t predicts token t + 1
        return float(-logp[:-1][keep].gather(-1, target[keep, None]).sum()), int(keep.sum())
    return nll


def hf_window_nll(model: Any) -> Nll:
    def nll(x: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
        with torch.no_grad():
            loss = model(x[None], labels=labels[None]).loss  # mean over the shifted labels
        n = int((labels[1:] != -100).sum())
        return float(loss) * n, n
    return nll


def encode(tokenizer_file: Path, text: str, n: int) -> list[int]:
    return Tokenizer.from_file(str(tokenizer_file)).encode(text, add_special_tokens=False).ids[:n]


@pytest.fixture(scope="module")
def text_file(stdlib_text: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Prose from the corpus' tail, which the tiny model (trained on its head) never saw."""
    path = tmp_path_factory.mktemp("eval-text") / "text.txt"
    path.write_text(stdlib_text[-8000:].strip(), "utf-8")
    return path


def test_windows_score_every_token_once() -> None:
    for n, window, stride in [(10, 4, 2), (11, 4, 3), (9, 9, 4), (20, 5, 1), (3, 8, 4)]:
        scored = [t for w in plan_windows(n, window, stride) for t in range(w.scored, w.end)]
        assert scored == list(range(1, n)), (n, window, stride)
    # stride == window: a window's first token has no context in it and is skipped
    assert [(w.begin, w.scored, w.end) for w in plan_windows(9, 4, 4)] == [
        (0, 1, 4), (4, 5, 8)]


def test_fp32_artifact_and_checkpoint_equal_reference(tiny_checkpoint: Path,
                                                      tiny_artifact: Path,
                                                      text_file: Path) -> None:
    text, source = load_text(str(text_file))
    assert text == text_file.read_text("utf-8") and source == str(text_file)
    ids = encode(tiny_artifact / "tokenizer.json", text, 700)
    ref_nll, ref_n = sliding_nll(ids, 128, 48, gpt_window_nll(load_checkpoint(
        tiny_checkpoint).model))
    assert ref_n == 699
    results = [evaluate(backend, text, source, max_tokens=700, window=128, stride=48)
               for backend in (artifact_backend(str(tiny_artifact)),
                               checkpoint_backend(str(tiny_checkpoint)))]
    n_bytes = len(Tokenizer.from_file(str(tiny_artifact / "tokenizer.json")).decode(
        ids).encode("utf-8"))
    for r in results:
        print(r["backend"], r["perplexity"], "reference", math.exp(ref_nll / ref_n))
        assert (r["tokens_scored"], r["window"], r["stride"]) == (ref_n, 128, 48)
        assert r["perplexity"] == pytest.approx(math.exp(ref_nll / ref_n), rel=1e-4)
        assert r["nll_sum"] == pytest.approx(ref_nll, rel=1e-4)
        assert r["bytes"] == n_bytes
        assert r["bits_per_byte"] == pytest.approx(ref_nll / math.log(2) / n_bytes, rel=1e-4)
    assert [r["backend"] for r in results] == ["onnx", "torch"]
    assert results[0]["perplexity"] == pytest.approx(results[1]["perplexity"], rel=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_imported_artifact_equals_transformers(family: str, llama_artifacts: Any,
                                               text_file: Path) -> None:
    built = llama_artifacts(family)
    text = text_file.read_text("utf-8")
    ids = encode(built.hf_dir / "tokenizer.json", text, 300)
    ref_nll, ref_n = sliding_nll(ids, 64, 24, hf_window_nll(load_hf_model(built.hf_dir)))
    r = evaluate(artifact_backend(str(built.artifact)), text, "t", max_tokens=300, window=64,
                 stride=24)
    print("ours", r["perplexity"], "transformers", math.exp(ref_nll / ref_n))
    assert r["tokens_scored"] == ref_n == 299
    assert r["perplexity"] == pytest.approx(math.exp(ref_nll / ref_n), rel=1e-4)


def test_int8_close_to_fp32(tiny_checkpoint: Path, tiny_artifact: Path, text_file: Path,
                            tmp_path: Path) -> None:
    from export.to_onnx import export_artifact

    int8 = export_artifact(tiny_checkpoint, tmp_path / "int8", quantize="int8")
    text, source = load_text(str(text_file))
    fp32, q = (evaluate(artifact_backend(str(path)), text, source, max_tokens=1024)
               for path in (tiny_artifact, int8))
    print(f"perplexity fp32 {fp32['perplexity']:.4f}, int8 {q['perplexity']:.4f}")
    assert (fp32["quantization"], q["quantization"]) == (None, "int8")
    assert q["tokens_scored"] == fp32["tokens_scored"] == 1023
    assert q["perplexity"] == pytest.approx(fp32["perplexity"], rel=0.03)


def test_cli_writes_and_prints_the_result(tiny_artifact: Path, text_file: Path,
                                          tmp_path: Path) -> None:
    out = tmp_path / "results" / "eval.json"
    result = subprocess.run(
        [sys.executable, "-m", "service.cli", "eval", "--model", str(tiny_artifact), "--data",
         str(text_file), "--max-tokens", "300", "--threads", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert printed == json.loads(out.read_text("utf-8"))
    assert printed["backend"] == "onnx" and printed["tokens_scored"] == 299
    assert printed["window"] == 128 and printed["stride"] == 64  # the tiny model's context
    assert "eval onnx" in result.stderr  # the progress bar
    assert [p.name for p in out.parent.iterdir()] == ["eval.json"]


def test_cli_checkpoint_on_the_builtin_corpus(tiny_checkpoint: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    args = ["eval", "--ckpt", str(tiny_checkpoint), "--data", "stdlib", "--max-tokens", "200",
            "--window", "64", "--threads", "1", "--no-progress"]
    assert main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["backend"] == "torch" and printed["data"].startswith("stdlib")
    assert (printed["tokens_scored"], printed["stride"]) == (199, 32)
    assert 1.0 < printed["perplexity"] < 384  # better than uniform over the vocabulary


@pytest.mark.parametrize(("case", "needle"), [
    ("missing file", "does not exist"),
    ("empty file", "is empty"),
    ("blank text", "holds no text"),
    ("one token", "at least 2"),
    ("window 1", "--window must be at least 2"),
    ("window past context", "exceeds the model's context"),
    ("stride 0", "--stride must be between 1"),
    ("stride past window", "--stride must be between 1"),
    ("both sources", "exactly one"),
    ("no source", "exactly one"),
])
def test_cli_bad_input_exits_2(case: str, needle: str, tiny_checkpoint: Path,
                               tiny_artifact: Path, text_file: Path, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    data, source = tmp_path / "data.txt", ["--model", str(tiny_artifact)]
    data.write_text({"empty file": "", "blank text": "\n \n<end>\n\n",
                     "one token": "a"}.get(case, text_file.read_text("utf-8")), "utf-8")
    extra = {"missing file": ["--data", str(tmp_path / "nope.txt")],
             "window 1": ["--window", "1"], "window past context": ["--window", "129"],
             "stride 0": ["--stride", "0"], "stride past window": ["--window", "8",
                                                                    "--stride", "9"],
             "both sources": ["--ckpt", str(tiny_checkpoint)]}.get(case, [])
    if case == "no source":
        source = []
    out = tmp_path / "out" / "eval.json"
    code = main(["eval", *source, "--data", str(data), *extra, "--threads", "1",
                 "--no-progress", "--json", str(out)])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and captured.out == ""
    assert len(lines) == 1 and lines[0].startswith("attnserve eval: error:") and needle in lines[0]
    assert not out.parent.exists()
