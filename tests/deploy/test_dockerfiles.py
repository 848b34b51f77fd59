"""Static checks of deploy/Dockerfile, deploy/Dockerfile.gpu and .dockerignore.

No container engine runs here, so these parse the Dockerfiles and check the properties the
deployment relies on; test_smoke.py then runs the runtime stage's command for real.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def stage_named(stages: list, name: str):
    matches = [s for s in stages if s.name == name]
    assert len(matches) == 1, f"expected exactly one stage named {name!r}"
    return matches[0]


def run_text(stage) -> str:
    return "\n".join(i.args for i in stage.all("RUN"))


def copied_from(stage, source_stage: str) -> list[str]:
    """`src dst` of every COPY --from=<source_stage> in the stage."""
    out = []
    for inst in stage.all("COPY"):
        words = inst.args.split()
        if f"--from={source_stage}" in words:
            out.append(" ".join(w for w in words if not w.startswith("--")))
    return out


@pytest.fixture(params=["cpu", "gpu"])
def flavour(request, cpu_stages, gpu_stages) -> tuple[str, list]:
    return request.param, (cpu_stages if request.param == "cpu" else gpu_stages)


def test_parser_reads_exec_forms_and_rejects_shell_forms(smoke) -> None:
    assert smoke.exec_form('["attnserve", "serve"]') == ["attnserve", "serve"]
    for shell_form in ("attnserve serve", "[]", '["a", 1]'):
        with pytest.raises(ValueError, match="exec-form"):
            smoke.exec_form(shell_form)


def test_parser_joins_continuations_and_reads_env(smoke, tmp_path) -> None:
    path = tmp_path / "Dockerfile"
    path.write_text('ARG X=1\nFROM a:1 AS one\nENV A=1 \\\n    # note\n    B="two words"\n'
                    'ENV LEGACY some value\nFROM one\nCMD ["x"]\n')
    first, second = smoke.parse_dockerfile(path)
    assert (first.base, first.name, second.base, second.name) == ("a:1", "one", "one", None)
    assert smoke.stage_env(first) == {"A": "1", "B": "two words", "LEGACY": "some value"}
    assert smoke.container_command(second) == ["x"]


def test_stages_model_venv_runtime(flavour) -> None:
    _, stages = flavour
    assert [s.name for s in stages] == ["model", "serve-venv", "runtime"]
    # the runtime stage is the last one, so a plain `docker build` produces it
    assert stages[-1].name == "runtime"


def test_runtime_installs_only_the_serve_extra_and_no_torch(flavour) -> None:
    kind, stages = flavour
    venv, runtime = stage_named(stages, "serve-venv"), stage_named(stages, "runtime")
    extra = "serve" if kind == "cpu" else "gpu"
    installs = run_text(venv)
    assert re.search(rf"pip install \"\.\[{extra}\]\"", installs), installs
    for text in (installs, run_text(runtime)):
        assert "torch" not in text
        assert not re.search(r"\[(train|export|dev)", text)
    # the runtime takes only the venv and the artifact from the other stages
    assert copied_from(runtime, "serve-venv") == ["/opt/venv /opt/venv"]
    assert copied_from(runtime, "model") == ["/artifact /models/default"]
    assert not runtime.all("ADD")
    assert all("--from=" in i.args for i in runtime.all("COPY")), "no sources copied in runtime"


def test_model_stage_trains_and_exports_or_copies_a_given_artifact(flavour) -> None:
    kind, stages = flavour
    model = stage_named(stages, "model")
    text = run_text(model)
    assert any(i.args.startswith("ARTIFACT_DIR") for i in model.all("ARG"))
    assert re.search(r"attnserve train --data stdlib --preset \"\$PRESET\" --out /ckpt", text)
    export = re.search(r"attnserve export --ckpt /ckpt --out /artifact([^;]*);", text)
    assert export, text
    if kind == "gpu":
        assert "--dtype float16" in export.group(1)
    else:
        assert "--dtype" not in export.group(1)
    assert 'torch==2.13.0" --index-url "$TORCH_INDEX_URL"' in text
    assert any(i.args == "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"
               for i in model.all("ARG"))
    assert 'cp -r "/ctx/$ARTIFACT_DIR" /artifact' in text
    assert 'test -f "/ctx/$ARTIFACT_DIR/manifest.json"' in text


def test_model_stage_commands_parse_with_the_real_cli(flavour) -> None:
    # The build runs for minutes inside Docker; at least its flags must exist here.
    import shlex

    from service.cli import build_parser

    kind, stages = flavour
    model = stage_named(stages, "model")
    preset = next(i.args.split("=", 1)[1] for i in model.all("ARG") if i.args.startswith("PRESET="))
    text = run_text(model).replace('"$PRESET"', preset)
    parser = build_parser()
    for sub in ("train", "export"):
        found = re.search(rf"/opt/build-venv/bin/attnserve ({sub} [^;&]*)", text)
        assert found, sub
        args = parser.parse_args(shlex.split(found.group(1)))
        assert args.command == sub
        if sub == "train":
            assert (args.data, args.preset, str(args.out)) == ("stdlib", "small", "/ckpt")
        else:
            assert (str(args.ckpt), str(args.out)) == ("/ckpt", "/artifact")
            assert args.dtype == ("float16" if kind == "gpu" else "float32")


def test_artifact_is_readable_by_the_runtime_user(flavour) -> None:
    # The exporter builds in a mkdtemp directory (mode 0700, owner root in the build), so
    # the model stage must open it up after training/copying, or user 10001 cannot load it.
    _, stages = flavour
    model = stage_named(stages, "model")
    runs = [i.args for i in model.all("RUN")]
    assert runs[-1] == "chmod -R a+rX /artifact"


def test_runtime_user_is_not_root(flavour) -> None:
    _, stages = flavour
    runtime = stage_named(stages, "runtime")
    user = runtime.last("USER")
    assert user is not None
    name = user.args.split(":")[0]
    assert name not in ("root", "0")
    assert "useradd --system --uid 10001" in run_text(runtime)
    assert name == "10001"  # numeric, so Kubernetes runAsNonRoot can verify it


def test_runtime_command_env_health_and_stop_signal(flavour, smoke) -> None:
    kind, stages = flavour
    runtime = stage_named(stages, "runtime")
    assert smoke.container_command(runtime) == ["attnserve", "serve"]
    env = smoke.stage_env(runtime)
    assert env["ATTNSERVE_MODEL"] == "/models/default"
    assert env["ATTNSERVE_HOST"] == "0.0.0.0"
    assert env["ATTNSERVE_PORT"] == "8000"
    assert env["ATTNSERVE_DEVICE"] == ("cpu" if kind == "cpu" else "cuda")
    assert float(env["ATTNSERVE_DRAIN_TIMEOUT"]) > 0
    assert env["PATH"].startswith("/opt/venv/bin:")
    expose = runtime.last("EXPOSE")
    assert expose is not None and expose.args == env["ATTNSERVE_PORT"]
    stop = runtime.last("STOPSIGNAL")
    assert stop is not None and stop.args == "SIGTERM"
    health = smoke.healthcheck_command(runtime)
    assert health[:2] == ["python", "-c"]
    assert "/ready" in health[2] and "ATTNSERVE_PORT" in health[2]
    assert "curl" not in " ".join(health) and "wget" not in " ".join(health)


def test_both_images_share_the_layout(cpu_stages, gpu_stages, smoke) -> None:
    cpu, gpu = cpu_stages[-1], gpu_stages[-1]
    assert smoke.container_command(cpu) == smoke.container_command(gpu)
    assert smoke.healthcheck_command(cpu) == smoke.healthcheck_command(gpu)
    same = ("ATTNSERVE_MODEL", "ATTNSERVE_HOST", "ATTNSERVE_PORT", "ATTNSERVE_DRAIN_TIMEOUT")
    cpu_env, gpu_env = smoke.stage_env(cpu), smoke.stage_env(gpu)
    assert {k: cpu_env[k] for k in same} == {k: gpu_env[k] for k in same}


def test_gpu_base_is_a_cuda_cudnn_runtime_image(gpu_stages) -> None:
    text = (REPO / "deploy" / "Dockerfile.gpu").read_text()
    base = re.search(r"^ARG CUDA_IMAGE=(\S+)$", text, re.M)
    assert base, "ARG CUDA_IMAGE=... missing"
    # onnxruntime-gpu >= 1.19 on PyPI is built for CUDA 12 + cuDNN 9
    assert re.fullmatch(r"nvidia/cuda:12\.\d+\.\d+-cudnn-runtime-ubuntu\d+\.\d+", base.group(1))
    assert stage_named(gpu_stages, "runtime").base == "${CUDA_IMAGE}"
    assert stage_named(gpu_stages, "serve-venv").base == "${CUDA_IMAGE}"


def test_dockerignore_keeps_environments_models_and_caches_out() -> None:
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for entry in (".venv", "checkpoints", "artifacts", ".git", "**/__pycache__",
                  ".pytest_cache", ".mypy_cache", ".ruff_cache", ".cache"):
        assert entry in ignored, entry
    # what the images COPY must stay in the context
    for needed in ("pyproject.toml", "README.md", "model", "export", "service", "deploy"):
        assert needed not in ignored
