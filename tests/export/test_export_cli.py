"""`attnserve export` on bad input: one-line error, non-zero exit, nothing half-written."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest

from model.tokenizer import build_char_tokenizer
from service.contract.manifest import verify_manifest


def attnserve(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "service.cli", "export", *map(str, args)],
                          capture_output=True, text=True, timeout=300, env=env)


def assert_clean_failure(result: subprocess.CompletedProcess[str], out: Path,
                         needle: str) -> None:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and needle in lines[0], result.stderr
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]


@pytest.fixture()
def ckpt_copy(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_checkpoint, tmp_path / "ckpt"))


def test_missing_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "out" / "art"
    out.parent.mkdir()
    assert_clean_failure(attnserve("--ckpt", tmp_path / "nope", "--out", out), out,
                         "does not exist")


def test_corrupt_weights(ckpt_copy: Path, tmp_path: Path) -> None:
    (ckpt_copy / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    out = tmp_path / "art"
    assert_clean_failure(attnserve("--ckpt", ckpt_copy, "--out", out), out, "corrupt")


@pytest.mark.parametrize("text", ['{"format_version": 1, "model": {"d_model": ', "[1, 2]"])
def test_corrupt_config(ckpt_copy: Path, tmp_path: Path, text: str) -> None:
    (ckpt_copy / "config.json").write_text(text)  # truncated JSON; valid JSON, not an object
    out = tmp_path / "art"
    assert_clean_failure(attnserve("--ckpt", ckpt_copy, "--out", out), out, "corrupt")


def test_tokenizer_not_matching_model_vocab(ckpt_copy: Path, tmp_path: Path) -> None:
    (ckpt_copy / "tokenizer.json").write_text(build_char_tokenizer(["abc"]).to_str())
    out = tmp_path / "art"
    assert_clean_failure(attnserve("--ckpt", ckpt_copy, "--out", out), out, "vocab_size")


def test_unsupported_opset(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "art"
    assert_clean_failure(attnserve("--ckpt", tiny_checkpoint, "--out", out, "--opset", "9"),
                         out, "opset")


def test_non_empty_output_needs_force_then_opset_option(tiny_checkpoint: Path,
                                                         tmp_path: Path) -> None:
    out = tmp_path / "art"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = attnserve("--ckpt", tiny_checkpoint, "--out", out)
    assert result.returncode != 0 and "--force" in result.stderr.strip().splitlines()[0]
    assert [p.name for p in out.iterdir()] == ["keep.txt"]

    result = attnserve("--ckpt", tiny_checkpoint, "--out", out, "--force", "--opset", "20")
    assert result.returncode == 0, result.stderr
    assert not (out / "keep.txt").exists()
    manifest = verify_manifest(out)
    assert manifest.opset == 20 and manifest.verification["passed"] is True
    opsets = {o.domain: o.version for o in onnx.load(str(out / "model.onnx")).opset_import}
    assert opsets[""] == 20
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 384
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".art")]


def test_sigterm_mid_export_leaves_nothing_behind(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """docker stop / kill during an export: the staging directory is removed too.

    The tiny export stages for a fraction of a second, so the signal can land after it has
    finished (exit 0, the artifact in place): such a run proves nothing and is run again,
    up to five times; at least one must have been stopped mid-export."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for attempt in range(5):
        runs = tmp_path / f"runs{attempt}"
        runs.mkdir()
        log = tmp_path / f"export{attempt}.log"
        with open(log, "wb") as sink:
            proc = subprocess.Popen([sys.executable, "-m", "service.cli", "export", "--ckpt",
                                     str(tiny_checkpoint), "--out", str(runs / "art")],
                                    stdout=sink, stderr=subprocess.STDOUT, env=env)
            try:
                deadline = time.monotonic() + 120
                while not list(runs.glob(".art.tmp-*")):  # staging has begun
                    assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                    time.sleep(0.05)
                proc.send_signal(signal.SIGTERM)
                code = proc.wait(timeout=120)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if code == 0:  # finished before the signal came: the artifact, and no staging left
            assert [p.name for p in runs.iterdir()] == ["art"], log.read_text()
            continue
        assert code == 128 + signal.SIGTERM, log.read_text()
        assert list(runs.iterdir()) == [], log.read_text()
        return
    pytest.fail("every export finished before SIGTERM reached it")
