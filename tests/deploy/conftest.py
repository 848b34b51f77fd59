"""Fixtures for the deploy checks: the parsed Dockerfiles, deploy/smoke.py, system tools, and
for the docker-compose end-to-end tests a Docker daemon, the images and the exported model.

The system tools (promtool, prometheus, docker-compose) come from Debian packages that
deploy/install-system-deps.sh installs (`make system-deps`, which `make test` runs). If they
are missing when pytest starts, the `system_tool` fixture runs that script once itself; a test
skips, with a loud reason, only when the tool still cannot be found afterwards.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
INSTALL_SCRIPT = DEPLOY / "install-system-deps.sh"


def _load_smoke() -> ModuleType:
    # deploy/ is not a package (it ships configs); load the stdlib-only script by path.
    spec = importlib.util.spec_from_file_location("attnserve_deploy_smoke", DEPLOY / "smoke.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


SMOKE = _load_smoke()


@pytest.fixture(scope="session")
def smoke() -> ModuleType:
    """deploy/smoke.py as a module (Dockerfile parsing, PromQL names, HTTP helpers)."""
    return SMOKE


@pytest.fixture(scope="session")
def cpu_stages() -> list:
    return SMOKE.parse_dockerfile(DEPLOY / "Dockerfile")


@pytest.fixture(scope="session")
def gpu_stages() -> list:
    return SMOKE.parse_dockerfile(DEPLOY / "Dockerfile.gpu")


_install_attempted: list[str] = []


@pytest.fixture(scope="session")
def system_tool() -> Callable[[str], str]:
    """system_tool(name) -> absolute path, installing the Debian packages once if needed."""

    def find(name: str) -> str:
        path = shutil.which(name)
        if path is None and not _install_attempted:
            proc = subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True,
                                  timeout=600, check=False)
            _install_attempted.append(proc.stderr[-2000:])
            path = shutil.which(name)
        if path is None:
            pytest.skip(f"!!! SKIPPED LOUDLY: `{name}` is not installed and "
                        f"{INSTALL_SCRIPT.name} could not install it (needs root + apt-get "
                        f"+ network; install the Debian packages prometheus and "
                        f"docker-compose). Installer said: "
                        f"{(_install_attempted or [''])[0].strip()[-300:]}")
        return path

    return find


# ---------------------------------------------------------------------------------------------
# docker-compose end to end (test_compose_e2e.py, test_compose_scale.py): a daemon of our own
# per module, stopped when the module ends (not idling through the rest of the suite); the
# images built once per machine and checked once per session; the real model exported once
# (`deploy_model`, in tests/conftest.py: tests/service/test_real_model.py checks that export).


@pytest.fixture(scope="module")
def docker_daemon(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A daemon on dockerd's default storage driver, or on the one a module parametrizes
    it with (test_compose_e2e.py runs on each of docker_harness.STORAGE_DRIVERS)."""
    from tests.deploy import docker_harness as harness

    reason = harness.unavailable_reason()
    if reason is not None:
        pytest.skip(f"!!! SKIPPED LOUDLY: docker-compose end-to-end tests cannot run: {reason}")
    daemon = harness.start_daemon(getattr(request, "param", None))
    try:
        yield daemon
    finally:
        harness.stop_daemon(daemon)


@pytest.fixture(scope="module")
def deploy_images(docker_daemon) -> dict[str, Any]:
    """`make images`' script against our daemon: a no-op check when the cache is warm.

    A daemon on another storage driver than dockerd's own (vfs) gets the images built on
    a default-driver daemon, moved with `docker save | docker load`: the same image ids,
    as a user would carry them to a vfs host, in a minute instead of the five a build
    takes on vfs (which copies the whole file system at every layer). Neither the build
    nor the builder daemon is needed again when the vfs daemon already holds the ids built
    earlier in this session."""
    from tests.deploy import docker_harness as harness

    started = time.monotonic()
    if docker_daemon.data_root == harness.data_root(None):
        return {"seconds": time.monotonic() - started, "log": build_images(docker_daemon)}
    built = _BUILT.get(harness.data_root(None))
    if built is not None and harness.image_ids(docker_daemon) == built[0]:
        return {"seconds": time.monotonic() - started, "log": built[1], "loaded": False}
    builder = harness.start_daemon(None)
    try:
        log = build_images(builder)
        moved = harness.transfer_images(builder, docker_daemon)
    finally:
        harness.stop_daemon(builder)
    return {"seconds": time.monotonic() - started, "log": log, "loaded": moved}


# data root -> (the image ids deploy/images/build.sh left there, its log), this session
_BUILT: dict[Path, tuple[list[str | None], str]] = {}


def build_images(daemon: Any) -> str:
    """Run deploy/images/build.sh against ``daemon``; its log. Once a session per data root:
    the sources do not change during a session, so another module's daemon on the same
    data root only checks that the images still have the ids that run left."""
    from tests.deploy import docker_harness as harness

    built = _BUILT.get(daemon.data_root)
    if built is not None and harness.image_ids(daemon) == built[0]:
        return built[1]
    proc = subprocess.run(["bash", str(DEPLOY / "images" / "build.sh")], env=daemon.env,
                          cwd=REPO, capture_output=True, text=True, timeout=1500, check=False)
    if proc.returncode != 0:
        pytest.fail(f"deploy/images/build.sh failed:\n{proc.stderr[-4000:]}")
    ids = harness.image_ids(daemon)
    assert None not in ids, f"deploy/images/build.sh left no {harness.DEPLOY_IMAGES}: {ids}"
    _BUILT[daemon.data_root] = (ids, proc.stderr)
    return proc.stderr
