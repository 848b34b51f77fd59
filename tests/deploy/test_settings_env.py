"""Every ATTNSERVE_* variable the deploy files set is a real `attnserve serve` setting.

A misspelt variable would be ignored silently by pydantic-settings (extra="ignore"), so the
deploy files are checked against the Settings model itself.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def setting_env_names() -> set[str]:
    settings = pytest.importorskip("service.settings")
    prefix = settings.Settings.model_config["env_prefix"]
    return {prefix + name.upper() for name in settings.Settings.model_fields}


def other_env_names() -> set[str]:
    """ATTNSERVE_* variables read outside the Settings model, each by its own module:
    the GGUF op library's path (service.ops, set in the CPU image)."""
    import service.ops

    return {service.ops.ENV_VAR}


def deploy_env_names() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for name in ("deploy/Dockerfile", "deploy/Dockerfile.gpu"):
        found[name] = set(re.findall(r"\b(ATTNSERVE_[A-Z_]+)=", (REPO / name).read_text()))
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    found["docker-compose.yml"] = {
        key for svc in compose["services"].values() for key in svc.get("environment", {})
        if key.startswith("ATTNSERVE_")}
    deployment = yaml.safe_load((REPO / "deploy/k8s/deployment.yaml").read_text())
    found["deploy/k8s/deployment.yaml"] = {
        e["name"] for c in deployment["spec"]["template"]["spec"]["containers"]
        for e in c["env"] if e["name"].startswith("ATTNSERVE_")}
    return found


def test_deploy_files_use_only_known_settings() -> None:
    known = setting_env_names()
    assert {"ATTNSERVE_MODEL", "ATTNSERVE_PORT", "ATTNSERVE_DRAIN_TIMEOUT"} <= known
    assert not known & other_env_names()
    known |= other_env_names()
    for source, names in deploy_env_names().items():
        assert names, source
        assert names <= known, f"{source}: unknown {sorted(names - known)}"
