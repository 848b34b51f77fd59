"""Static checks of deploy/Dockerfile, deploy/Dockerfile.gpu and .dockerignore.

These parse the Dockerfiles and check the properties the deployment relies on, with no
container engine; test_smoke.py runs the runtime stage's command on the host, and
test_compose_e2e.py builds and runs the images themselves where a dockerd can run.
"""

from __future__ import annotations

import re
import tomllib
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


def test_stages_venv_runtime(flavour) -> None:
    kind, stages = flavour
    builders = ["gguf-ops", "serve-venv"] if kind == "cpu" else ["serve-venv"]
    assert [s.name for s in stages] == [*builders, "runtime"]
    # the runtime stage is the last one, so a plain `docker build` produces it


def test_runtime_installs_only_the_serve_extra_and_no_torch(flavour) -> None:
    kind, stages = flavour
    venv, runtime = stage_named(stages, "serve-venv"), stage_named(stages, "runtime")
    extra = "serve" if kind == "cpu" else "gpu"
    installs = run_text(venv)
    assert re.search(rf"pip install \"\.\[{extra}\]\"", installs), installs
    for text in (installs, run_text(runtime)):
        assert "torch" not in text
        assert not re.search(r"\[(train|export|dev)", text)
    # the runtime takes only the venv from the other stage: no sources, no build inputs
    assert copied_from(runtime, "serve-venv") == ["/opt/venv /opt/venv"]
    assert not runtime.all("ADD")
    assert all("--from=" in i.args for i in runtime.all("COPY")), "no sources copied in runtime"


def test_no_model_is_built_into_the_images(flavour) -> None:
    # The model is mounted read-only at /models/default (docker-compose.yml, make
    # deploy-model); the images neither train nor export nor copy one.
    kind, stages = flavour
    text = (REPO / "deploy" / ("Dockerfile" if kind == "cpu" else "Dockerfile.gpu")).read_text()
    for stage in stages:
        assert not re.search(r"attnserve (train|export|import)", run_text(stage))
        assert not any(i.args.startswith("ARTIFACT_DIR") for i in stage.all("ARG"))
    assert "/models/default:ro" in text  # the usage comment shows the mount


def test_images_build_with_the_classic_builder(flavour) -> None:
    # dockerd 20.10 + compose v1 build without BuildKit: no `# syntax=` (BuildKit would pull
    # a frontend image from a registry) and no RUN --mount.
    kind, _ = flavour
    text = (REPO / "deploy" / ("Dockerfile" if kind == "cpu" else "Dockerfile.gpu")).read_text()
    assert not re.search(r"^# *syntax=", text, re.M)
    assert "--mount" not in text


def test_cpu_base_image_is_a_build_argument(cpu_stages) -> None:
    text = (REPO / "deploy" / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim-bookworm$", text, re.M)
    assert [s.base for s in cpu_stages] == ["${BASE_IMAGE}"] * 3


def test_cpu_build_installs_host_prepared_wheels_offline(cpu_stages) -> None:
    venv = stage_named(cpu_stages, "serve-venv")
    copies = [i.args for i in venv.all("COPY")]
    assert copies[0] == "deploy/images/wheels/ /wheels/"
    text = run_text(venv)
    # the dependency layer comes before the sources, so source edits keep it cached
    assert text.index("--no-index --no-deps /wheels/*.whl") < text.index('install ".[serve]"')
    assert "export PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheels" in text
    ignore = (REPO / "deploy" / "images" / "wheels" / ".gitignore").read_text().split()
    assert ignore[-2:] == ["*", "!.gitignore"]  # the wheels are never committed


def test_cpu_image_ships_the_gguf_op_library_built_portably(cpu_stages, smoke) -> None:
    """`--kernel ggml` artifacts need service/ops' library: compiled in its own stage for any
    x86-64-v3 CPU (not -march=native), the runtime taking the three .so files and
    build-info.json only (no compiler, no build tree), found through ATTNSERVE_GGUF_OPS."""
    ops, runtime = stage_named(cpu_stages, "gguf-ops"), stage_named(cpu_stages, "runtime")
    build = run_text(ops)
    assert "service/ops/build.py --portable" in build
    assert "native" not in build
    assert re.search(r"apt-get install .*--no-install-recommends cmake ninja-build g\+\+", build)
    assert "cp -L /build/current/*.so* /build/current/build-info.json /opt/attnserve/gguf-ops/" \
        in build
    # the stage copies the op's sources and build.py, no other Python source: editing the
    # service keeps ggml's compile cached
    copies = [i.args.split() for i in ops.all("COPY")]
    assert copies[0] == ["deploy/images/gguf-ops/", "/src/.cache/"]
    sources = [w for words in copies[1:] for w in words[:-1]]
    assert "service/ops/build.py" in sources
    assert all(w.startswith("service/ops/") for w in sources), sources
    assert not [w for w in sources if w.endswith(".py") and w != "service/ops/build.py"]
    assert copied_from(runtime, "gguf-ops") == ["/opt/attnserve/gguf-ops /opt/attnserve/gguf-ops"]
    env = smoke.stage_env(runtime)
    assert env["ATTNSERVE_GGUF_OPS"] == "/opt/attnserve/gguf-ops/libattnserve_gguf_ops.so"
    for tool in ("apt-get", "g++", "gcc", "cmake", "ninja", "build-essential"):
        assert tool not in run_text(runtime), f"{tool} in the runtime stage"
    # the inputs the host prepares are never committed, and the stage is tagged so that the
    # prune after a build keeps its layer cache
    ignore = (REPO / "deploy" / "images" / "gguf-ops" / ".gitignore").read_text().split()
    assert ignore[-2:] == ["*", "!.gitignore"]
    script = (REPO / "deploy" / "images" / "build.sh").read_text()
    assert "build attnserve-build:gguf-ops " in script and "--target gguf-ops" in script
    assert script.index("build attnserve-build:gguf-ops ") < script.index("build attnserve:cpu ")


def test_deploy_model_makes_the_artifact_readable_by_the_runtime_user() -> None:
    # The container runs as uid 10001 and reads the bind-mounted artifact.
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile.split("\ndeploy-model: artifact\n", 1)[1].split("\n\n", 1)[0]
    assert "chmod -R a+rX $(ARTIFACT)" in recipe


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
    # onnxruntime-gpu >= 1.27 on PyPI is built for CUDA 13 + cuDNN 9 (1.19-1.26: CUDA 12)
    assert re.fullmatch(r"nvidia/cuda:13\.\d+\.\d+-cudnn-runtime-ubuntu\d+\.\d+", base.group(1))
    assert stage_named(gpu_stages, "runtime").base == "${CUDA_IMAGE}"
    assert stage_named(gpu_stages, "serve-venv").base == "${CUDA_IMAGE}"


def test_the_gpu_extra_asks_for_an_onnxruntime_gpu_built_for_the_images_cuda() -> None:
    """An unpinned onnxruntime-gpu follows PyPI's newest build, whose CUDA major moved from
    12 to 13 at 1.27: the extra's floor must be a release built for the base image's."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    (spec,) = [d for d in extras["gpu"] if d.startswith("onnxruntime-gpu")]
    floor = re.fullmatch(r"onnxruntime-gpu>=(\d+)\.(\d+)(?:\.\d+)?", spec)
    assert floor, spec
    base = re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:(\d+)\.",
                     (REPO / "deploy" / "Dockerfile.gpu").read_text(), re.M)
    assert base
    assert int(base.group(1)) == 13, "a CUDA 12 base needs onnxruntime-gpu>=1.19,<1.27"
    assert (int(floor.group(1)), int(floor.group(2))) >= (1, 27)


def test_dockerignore_keeps_environments_models_and_caches_out() -> None:
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for entry in (".venv", "checkpoints", "artifacts", ".git", "**/__pycache__",
                  ".pytest_cache", ".mypy_cache", ".ruff_cache", ".cache"):
        assert entry in ignored, entry
    # what the images COPY must stay in the context
    for needed in ("pyproject.toml", "README.md", "model", "export", "service", "deploy"):
        assert needed not in ignored
