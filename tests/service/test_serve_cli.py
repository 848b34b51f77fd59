"""`attnserve serve` refusals at start, provider selection and settings from the environment."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from service import providers
from service.contract import io_spec as io
from service.settings import Limits, Settings


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSERVE_")}
    environment.update(env or {})
    return subprocess.run([sys.executable, "-m", "service.cli", "serve", *args], text=True,
                          capture_output=True, timeout=60, env=environment)


def test_a_tampered_artifact_refuses_to_start(artifact: Path, tmp_path: Path) -> None:
    copy = tmp_path / "artifact"
    shutil.copytree(artifact, copy)
    data = bytearray((copy / io.MODEL_FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    (copy / io.MODEL_FILE).write_bytes(bytes(data))
    result = serve("--model", str(copy), "--port", "0")
    assert result.returncode == 2
    assert "model.onnx does not match its sha256" in result.stderr
    assert result.stderr.count("\n") == 1  # one line, no traceback

    shutil.copyfile(artifact / io.MODEL_FILE, copy / io.MODEL_FILE)
    tokenizer = (copy / io.TOKENIZER_FILE).read_bytes()
    (copy / io.TOKENIZER_FILE).write_bytes(tokenizer[:len(tokenizer) // 2])
    truncated = serve("--model", str(copy), "--port", "0")
    assert truncated.returncode == 2
    assert "tokenizer.json has" in truncated.stderr and "truncated" in truncated.stderr


def test_missing_model_is_a_one_line_error() -> None:
    result = serve()
    assert result.returncode == 2
    assert "--model (or ATTNSERVE_MODEL) is required" in result.stderr


@pytest.mark.parametrize("key", ["", " "])
def test_a_blank_api_key_is_refused_at_start(artifact: Path, key: str) -> None:
    """Else `Authorization: Bearer ` (an empty token) would pass the constant-time check."""
    result = serve("--model", str(artifact), "--port", "0", env={"ATTNSERVE_API_KEY": key})
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "ATTNSERVE_API_KEY is set but empty" in (
        result.stderr)


def test_device_cuda_without_cuda_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(providers.ort, "get_available_providers",
                        lambda: ["CPUExecutionProvider"])
    with pytest.raises(providers.DeviceError, match="CUDAExecutionProvider"):
        providers.select_providers("cuda")
    assert providers.select_providers("auto") == ["CPUExecutionProvider"]
    monkeypatch.setattr(providers.ort, "get_available_providers",
                        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert providers.select_providers("auto") == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert providers.select_providers("cpu") == ["CPUExecutionProvider"]


def test_device_cuda_on_this_machine_exits_2_or_runs_on_cuda(artifact: Path) -> None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        assert providers.select_providers("cuda")[0] == "CUDAExecutionProvider"
        return
    result = serve("--model", str(artifact), "--device", "cuda", "--port", "0")
    assert result.returncode == 2
    assert "--device cuda" in result.stderr and "onnxruntime-gpu" in result.stderr


def test_settings_come_from_the_environment_and_flags_win(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ATTNSERVE_MODEL", str(tmp_path))
    monkeypatch.setenv("ATTNSERVE_MAX_BATCH_SIZE", "3")
    monkeypatch.setenv("ATTNSERVE_API_KEY", "k")
    monkeypatch.setenv("ATTNSERVE_DEVICE", "cpu")
    settings = Settings()
    assert (settings.model, settings.max_batch_size, settings.device) == (tmp_path, 3, "cpu")
    assert settings.api_key is not None and settings.api_key.get_secret_value() == "k"
    assert Settings(max_batch_size=5).max_batch_size == 5
    monkeypatch.setenv("ATTNSERVE_MAX_BATCH_SIZE", "zero")
    with pytest.raises(ValueError, match="max_batch_size"):
        Settings()


def test_limits_default_to_the_context_and_refuse_impossible_values(tmp_path: Path) -> None:
    limits = Limits.resolve(Settings(model=tmp_path), context_length=128)
    assert (limits.max_total_tokens, limits.max_input_tokens, limits.max_new_tokens) == (
        128, 127, 127)
    with pytest.raises(ValueError, match="context length"):
        Limits.resolve(Settings(model=tmp_path, max_total_tokens=256), 128)
    with pytest.raises(ValueError, match="max_batch_tokens"):
        Limits.resolve(Settings(model=tmp_path, max_batch_tokens=64), 128)


def _serve_parser() -> Any:
    import argparse

    from service.serve_cli import register

    root = argparse.ArgumentParser(prog="attnserve")
    register(root.add_subparsers())
    return root


def test_every_setting_is_a_flag_with_its_type_and_default_in_the_help() -> None:
    """The flags are generated from Settings: one per field (the API key, a secret, only
    from the environment), parsed to the field's type, bools as --x/--no-x, Literals as
    choices, and the help naming each field's default."""
    import argparse

    root = _serve_parser()
    serve_parser = next(a for a in root._actions
                        if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    flags = {a.dest: a for a in serve_parser._actions if a.dest != "help"}
    assert set(flags) == set(Settings.model_fields) - {"api_key"}
    for name, field in Settings.model_fields.items():
        if name == "api_key" or field.get_default() is None or field.is_required():
            continue
        default = field.get_default()
        shown = ("on" if default else "off") if isinstance(default, bool) else str(default)
        if isinstance(default, tuple):  # NAME=DIR [NAME=DIR ...]: several values
            assert flags[name].nargs == "+", name
            shown = " ".join(default) or "none"
        assert f"(default {shown})" in flags[name].help or flags[name].help == (
            f"default {shown}"), (name, flags[name].help)
    args = root.parse_args(["serve", "--model", "m", "--max-batch-size", "7",
                            "--drain-timeout", "2.5", "--no-prefix-caching",
                            "--device", "cpu", "--speculative-model", "ngram",
                            "--lora-modules", "a=/x", "b=/y"])
    assert args.lora_modules == ["a=/x", "b=/y"]
    assert (args.max_batch_size, args.drain_timeout, args.prefix_caching, args.device,
            args.speculative_model, args.port) == (7, 2.5, False, "cpu", "ngram", None)
    with pytest.raises(SystemExit):
        root.parse_args(["serve", "--device", "tpu"])
    with pytest.raises(SystemExit):
        root.parse_args(["serve", "--api-key", "secret"])


def test_a_flag_wins_over_the_environment_and_the_environment_over_the_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from service.serve_cli import settings_from

    root = _serve_parser()
    for key in [k for k in os.environ if k.startswith("ATTNSERVE_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("ATTNSERVE_MAX_BATCH_SIZE", "5")
    monkeypatch.setenv("ATTNSERVE_PREFIX_CACHING", "false")
    settings = settings_from(root.parse_args(["serve", "--model", "m",
                                              "--max-batch-size", "7"]))
    assert (settings.max_batch_size, settings.prefix_caching) == (7, False)
    assert settings.max_queued_requests == 128 and settings.port == 8000  # the defaults
    monkeypatch.setenv("ATTNSERVE_MAX_BATCH_SIZE", "0")
    with pytest.raises(ValueError, match="invalid setting max_batch_size"):
        settings_from(root.parse_args(["serve", "--model", "m"]))
    monkeypatch.delenv("ATTNSERVE_MAX_BATCH_SIZE")
    with pytest.raises(ValueError, match=r"--model \(or ATTNSERVE_MODEL\) is required"):
        settings_from(root.parse_args(["serve"]))


def test_the_engine_configs_take_their_defaults_from_settings() -> None:
    """One source for each default: an engine made without settings (tests, benchmarks)
    runs as a server started without flags does (on the CPU rather than ``auto``), and
    the scheduler's and speculation's settings carry the Settings names and defaults."""
    import dataclasses

    from service.engine.engine import EngineConfig
    from service.engine.scheduler import SchedulerLimits
    from service.engine.speculative import SpeculativeConfig

    config = EngineConfig()
    assert set(EngineConfig.model_fields) == set(Settings.model_fields) - {"model"}
    for name in EngineConfig.model_fields:
        if name != "device":
            assert getattr(config, name) == Settings.model_fields[name].get_default(), name
    assert config.device == "cpu" and config.speculative is None
    not_settings = {"method", "probe_budget", "max_pause"}
    for small in (SchedulerLimits(), SpeculativeConfig()):
        for f in dataclasses.fields(small):
            if f.name not in not_settings:
                assert getattr(small, f.name) == Settings.model_fields[f.name].get_default(), (
                    f.name)


def test_every_setting_reaches_the_engine_config() -> None:
    """EngineConfig.from_settings carries every setting (the limits as resolved for the
    model), and the scheduler's limits and the speculation take theirs from it by name:
    each given a value other than its default arrives as that value."""
    import dataclasses

    from service.engine.engine import EngineConfig
    from service.engine.scheduler import SchedulerLimits
    from service.settings import of_settings

    changed: dict[str, object] = {
        "device": "cpu", "intra_op_threads": 3, "engine_graph": False, "cuda_graphs": False,
        "mixed_steps": False, "max_batch_size": 5, "max_batch_tokens": 4000,
        "max_queued_requests": 7, "max_total_tokens": 1000, "kv_cache_memory_mb": 12.5,
        "prefix_caching": False, "prefix_cache_memory_mb": 9.0, "prefix_block_size": 32,
        "prefill_chunk_tokens": 48, "float32_pass_tokens": 99,
        "adaptive_prefill_chunks": False, "max_batch_prefill_tokens": 300, "huge_pages": True,
        "speculative_model": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5,
        "prompt_lookup_min": 3, "speculative_max_batch_rows": 2,
        "speculative_adaptive": False}
    settings = Settings(model=Path("m"), **changed)  # type: ignore[arg-type]
    limits = Limits.resolve(settings, 2048)
    config = EngineConfig.from_settings(settings, limits)
    resolved = {f.name for f in dataclasses.fields(Limits)}
    for name in EngineConfig.model_fields:
        source = limits if name in resolved else settings
        assert getattr(config, name) == getattr(source, name), name
    for name, value in changed.items():
        assert getattr(config, name) == value, name
    for small in (of_settings(SchedulerLimits, config), config.speculative):
        assert small is not None
        for f in dataclasses.fields(small):
            if f.name in changed:
                assert getattr(small, f.name) == changed[f.name], f.name
    assert config.speculative is not None and config.speculative.method == "ngram"


@pytest.mark.parametrize(("change", "reason"), [
    ("rank", "above --max-lora-rank 4"),
    ("shape", "maps 64 → 3 features"),
    ("entry", "is not NAME=DIR"),
    ("artifact", "this artifact has no adapter graph"),
])
def test_an_adapter_that_does_not_fit_stops_the_server_with_one_line(
        lora_build: Any, artifact: Path, tmp_path: Path, change: str, reason: str) -> None:
    """Each --lora-modules adapter is read and checked before the server starts: a rank
    above --max-lora-rank, shapes of another model, a malformed entry, an artifact without
    adapter graphs: exit 2, one line naming it."""
    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(lora_build.adapters["alpha"], bad)  # rank 8
    if change == "shape":
        tensors = load_file(str(bad / "adapter_model.safetensors"))
        key = next(k for k in tensors if k.endswith("q_proj.lora_B.weight"))
        tensors[key] = tensors[key][:3]
        save_file(tensors, str(bad / "adapter_model.safetensors"))
    model = artifact if change == "artifact" else lora_build.artifact
    entry = str(bad) if change == "entry" else f"bad={bad}"
    result = serve("--model", str(model), "--port", "0", "--device", "cpu",
                   "--max-lora-rank", "4" if change == "rank" else "8",
                   "--lora-modules", entry)
    assert result.returncode == 2, result.stderr[-2000:]
    assert reason in result.stderr, result.stderr[-2000:]
    assert result.stderr.count("\n") == 1, result.stderr[-2000:]  # no traceback
