"""`attnserve train` / `attnserve sample` as a user runs them: real subprocesses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from model.checkpoint import load_checkpoint
from model.sample import generate
from model.tokenizer import decode, encode

ATTNSERVE = shutil.which("attnserve", path=str(Path(sys.executable).parent)) or "attnserve"


def run_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("ATTNSERVE_DEBUG", None)
    return subprocess.run([ATTNSERVE, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, check=False)


def run_clis(*commands: list[str]) -> list[subprocess.CompletedProcess[str]]:
    """Independent CLI runs side by side, results in order: each one is a fresh process that
    spends seconds importing torch on one thread, so a serial loop would leave cores idle."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(lambda args: run_cli(*args), commands))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory, stdlib_text: str) -> Path:
    path = tmp_path_factory.mktemp("cli") / "corpus.txt"
    path.write_text(stdlib_text[:20_000], encoding="utf-8")
    return path


def _error_cases(tmp: Path, corpus: Path) -> list[tuple[list[str], str]]:
    empty = tmp / "empty.txt"
    empty.write_text("")
    short = tmp / "short.txt"
    short.write_text("Too short for any context.\n")
    latin = tmp / "latin.txt"
    latin.write_bytes("déjà vu, encore et encore\n".encode("latin-1") * 50)
    blocker = tmp / "a-file"
    blocker.write_text("x")
    fake_pt = tmp / "model.pt"
    fake_pt.write_bytes(b"\x80\x04")
    out = str(tmp / "out")
    return [
        (["train", "--data", str(tmp / "missing.txt"), "--out", out], "does not exist"),
        (["train", "--data", str(empty), "--out", out], "is empty"),
        (["train", "--data", str(latin), "--out", out], "not UTF-8"),
        (["train", "--data", str(short), "--preset", "tiny", "--tokenizer", "char",
          "--out", out], "corpus too short"),
        (["train", "--data", str(corpus), "--preset", "huge", "--out", out], "unknown preset"),
        (["train", "--data", str(corpus), "--steps", "0", "--out", out], "must be positive"),
        (["train", "--data", str(corpus), "--steps", "-5", "--out", out], "must be positive"),
        (["train", "--data", str(corpus), "--out", str(blocker / "ckpt")], "cannot write"),
        (["train", "--data", str(corpus), "--out", str(tmp / "none"), "--resume"],
         "does not exist"),
        (["sample", "--ckpt", str(fake_pt), "--prompt", "hi"], "pickle"),
        (["sample", "--ckpt", str(tmp / "none"), "--prompt", "hi"], "does not exist"),
    ]


def test_cli_bad_input_gives_one_line_error_and_nonzero_exit(tmp_path, corpus):
    cases = _error_cases(tmp_path, corpus)
    for (args, message), proc in zip(cases, run_clis(*(args for args, _ in cases)),
                                     strict=True):
        assert proc.returncode != 0, args
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, (args, proc.stderr)
        assert lines[0].startswith(f"attnserve {args[0]}: error:") and message in lines[0], (
            args, lines)
    assert not (tmp_path / "out").exists()


def test_cli_help_documents_every_option():
    for command, options in (
        ("train", ["--data", "--preset", "--out", "--steps", "--time-budget", "--seed",
                   "--device", "--resume", "--tokenizer", "--vocab-size", "--position",
                   "--activation", "--tie-weights", "--batch-size", "--lr",
                   "--eval-interval"]),
        ("sample", ["--ckpt", "--prompt", "--max-new-tokens", "--temperature", "--top-k",
                    "--top-p", "--seed", "--greedy"]),
    ):
        proc = run_cli(command, "--help")
        assert proc.returncode == 0
        for option in options:
            assert option in proc.stdout, (command, option)


def test_cli_train_then_sample(tmp_path, corpus):
    ckpt = tmp_path / "ckpt"
    proc = run_cli("train", "--data", str(corpus), "--preset", "tiny", "--tokenizer", "char",
                   "--context", "64", "--steps", "30", "--batch-size", "8", "--seed", "1",
                   "--out", str(ckpt))
    assert proc.returncode == 0, proc.stderr
    assert "unigram baseline" in proc.stdout and "val loss" in proc.stdout
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "config.json", "metrics.jsonl", "model.safetensors", "tokenizer.json",
        "train_state.safetensors"]

    # Four samplings of the same checkpoint, side by side (none writes it).
    sample = ["sample", "--ckpt", str(ckpt)]
    seeded_args = [*sample, "--prompt", "", "--seed", "3", "--temperature", "1.0", "--top-k",
                   "20", "--top-p", "0.95", "--max-new-tokens", "15"]
    proc, *seeded_runs, bad = run_clis(
        [*sample, "--prompt", "ROMEO:", "--greedy", "--max-new-tokens", "20"],
        seeded_args, seeded_args, [*sample, "--prompt", "x", "--top-p", "0"])
    assert proc.returncode == 0, proc.stderr
    # The CLI prints exactly what the in-process reference decode produces.
    loaded = load_checkpoint(ckpt)
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    ids = torch.tensor([encode(tok, "ROMEO:")])
    out = generate(loaded.model, ids, 20, greedy=True, eos_token_id=2)
    new = [t for t in out.new_tokens(ids.shape[1])[0].tolist()]
    new = new[: new.index(2)] if 2 in new else new
    assert proc.stdout == decode(tok, new) + "\n"

    seeded = [run.stdout for run in seeded_runs]
    assert seeded[0] == seeded[1] and seeded[0].strip()

    assert bad.returncode != 0 and "top_p" in bad.stderr

    resumed = run_cli("train", "--data", str(corpus), "--out", str(ckpt), "--resume",
                      "--steps", "36")
    assert resumed.returncode == 0, resumed.stderr
    meta = json.loads((ckpt / "config.json").read_text())
    assert meta["training"]["steps"] == 36 and meta["training"]["preset"] == "tiny"
    assert meta["model"]["max_seq_len"] == 64  # the checkpoint's own config, not the preset's
    assert len((ckpt / "metrics.jsonl").read_text().splitlines()) == 36
