"""Fixtures for the deploy checks: the parsed Dockerfiles, deploy/smoke.py, system tools.

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
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

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
