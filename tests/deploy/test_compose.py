"""docker-compose.yml: parsed by the real docker-compose, and wired the way the stack needs.

`docker-compose config` (Debian package, Compose v1.29) resolves the file offline: profiles,
extension fields, depends_on conditions and device reservations must all be accepted.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def compose_config(docker_compose: str, *args: str, env: dict[str, str] | None = None) -> dict:
    proc = subprocess.run([docker_compose, "-f", str(REPO / "docker-compose.yml"), *args,
                           "config"], capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={**os.environ, **(env or {})}, check=False)
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


def bind_mounts(service: dict) -> dict[str, tuple[Path, bool]]:
    """target -> (source, read_only) for bind mounts, from v1 short or v2 long syntax."""
    mounts = {}
    for volume in service["volumes"]:
        if isinstance(volume, str):
            source, target, *mode = volume.split(":")
            read_only = mode == ["ro"]
        else:
            source, target = volume["source"], volume["target"]
            read_only = bool(volume.get("read_only"))
        if source.startswith("/"):
            mounts[target] = (Path(source), read_only)
    return mounts


@pytest.fixture(scope="module")
def docker_compose(system_tool) -> str:
    return system_tool("docker-compose")


@pytest.fixture(scope="module")
def resolved(docker_compose) -> dict:
    return compose_config(docker_compose)


def test_docker_compose_config_parses_all_services(resolved) -> None:
    assert set(resolved["services"]) == {"attnserve", "attnserve-gpu", "prometheus", "grafana"}


def test_docker_compose_rejects_a_broken_file(docker_compose, tmp_path) -> None:
    # the check above means something only if docker-compose does reject bad files
    bad = tmp_path / "docker-compose.yml"
    bad.write_text("services:\n  x:\n    image: a\n    depends_on:\n"
                   "      y:\n        condition: service_healthy\n")
    proc = subprocess.run([docker_compose, "-f", str(bad), "config"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode != 0
    assert "y" in proc.stderr


def test_service_builds_cpu_image_and_serves_on_8000(resolved, cpu_stages, smoke) -> None:
    svc = resolved["services"]["attnserve"]
    assert svc["build"]["dockerfile"] == "deploy/Dockerfile"
    assert Path(svc["build"]["context"]) == REPO
    assert svc["build"]["args"] == {"ARTIFACT_DIR": ""}
    port = smoke.stage_env(cpu_stages[-1])["ATTNSERVE_PORT"]
    assert {"published": 8000, "target": int(port)}.items() <= svc["ports"][0].items()
    assert svc["stop_signal"] == "SIGTERM"


def test_healthchecks_match_the_image_healthcheck(resolved, cpu_stages, smoke) -> None:
    image_check = smoke.healthcheck_command(cpu_stages[-1])
    for name in ("attnserve", "attnserve-gpu"):
        check = resolved["services"][name]["healthcheck"]
        assert check["test"] == ["CMD", *image_check], name


def test_stop_grace_period_covers_the_drain(resolved, cpu_stages, smoke) -> None:
    def seconds(value: str) -> float:
        units = {"s": 1, "m": 60}
        return float(value[:-1]) * units[value[-1]]

    for name in ("attnserve", "attnserve-gpu"):
        svc = resolved["services"][name]
        drain = float(svc["environment"]["ATTNSERVE_DRAIN_TIMEOUT"])
        assert seconds(svc["stop_grace_period"]) >= drain + 5, name


def test_api_key_is_passed_through_only_when_set(docker_compose) -> None:
    unset = compose_config(docker_compose, env={"ATTNSERVE_API_KEY": ""})
    # an empty string would turn auth on with an empty key; null means "not passed"
    assert unset["services"]["attnserve"]["environment"]["ATTNSERVE_API_KEY"] in (None, "")
    with_key = compose_config(docker_compose, env={"ATTNSERVE_API_KEY": "s3cret"})
    assert with_key["services"]["attnserve"]["environment"]["ATTNSERVE_API_KEY"] == "s3cret"


def test_startup_order_waits_for_health(resolved) -> None:
    services = resolved["services"]
    assert services["prometheus"]["depends_on"] == {"attnserve": {"condition": "service_healthy"}}
    assert services["grafana"]["depends_on"] == {"prometheus": {"condition": "service_healthy"}}
    assert "healthcheck" in services["prometheus"]


def test_gpu_profile_reserves_an_nvidia_device(resolved, docker_compose) -> None:
    gpu = resolved["services"]["attnserve-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["build"]["dockerfile"] == "deploy/Dockerfile.gpu"
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert gpu["ports"][0]["published"] != 8000  # runs beside the CPU service
    # only the gpu profile is optional: the default stack starts the other three
    for name in ("attnserve", "prometheus", "grafana"):
        assert "profiles" not in resolved["services"][name]
    with_profile = compose_config(docker_compose, "--profile", "gpu")
    assert "attnserve-gpu" in with_profile["services"]


def test_prometheus_mounts_config_and_rules(resolved) -> None:
    prom = resolved["services"]["prometheus"]
    assert bind_mounts(prom)["/etc/prometheus"] == (REPO / "deploy" / "prometheus", True)
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    assert (REPO / "deploy" / "prometheus" / "prometheus.yml").is_file()
    assert {"published": 9090, "target": 9090}.items() <= prom["ports"][0].items()


def test_grafana_is_provisioned_and_anonymous(resolved) -> None:
    graf = resolved["services"]["grafana"]
    env = graf["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    mounts = bind_mounts(graf)
    assert mounts["/etc/grafana/provisioning"] == (REPO / "deploy/grafana/provisioning", True)
    dash_dir = REPO / "deploy" / "grafana" / "dashboards"
    assert mounts["/etc/grafana/dashboards"] == (dash_dir, True)
    home = env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith("/etc/grafana/dashboards/")
    home_file = dash_dir / Path(home).name
    assert json.loads(home_file.read_text())["uid"] == "attnserve"
    provider = yaml.safe_load((REPO / "deploy/grafana/provisioning/dashboards/attnserve.yml")
                              .read_text())["providers"][0]
    assert provider["options"]["path"] == "/etc/grafana/dashboards"
    assert {"published": 3000, "target": 3000}.items() <= graf["ports"][0].items()
