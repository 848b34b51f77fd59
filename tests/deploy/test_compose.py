"""docker-compose.yml: parsed by the real docker-compose, and wired the way the stack needs.

`docker-compose config` (Debian package, Compose v1.29) resolves the file offline: profiles,
extension fields, depends_on conditions and device reservations must all be accepted.
test_compose_e2e.py and test_compose_scale.py then run the file for real.
"""

from __future__ import annotations

import json
import os
import re
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


def port(entry: str | dict) -> tuple[str, str, int]:
    """(host ip, published port or range, container port) from v1 short or v2 long syntax."""
    if isinstance(entry, dict):
        return entry.get("host_ip", ""), str(entry["published"]), int(entry["target"])
    *host, target = entry.split("/")[0].split(":")
    ip, published = host if len(host) == 2 else ("", host[0])
    return ip, published, int(target)


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
    assert set(resolved["services"]) == {"attnserve", "attnserve-gpu", "prometheus", "proxy",
                                         "grafana"}


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
    assert svc["build"]["args"] == {"BASE_IMAGE": "python:3.11-slim-bookworm"}
    assert svc["image"] == "attnserve:cpu"  # what `make images` tags
    container_port = int(smoke.stage_env(cpu_stages[-1])["ATTNSERVE_PORT"])
    # one replica takes 8000; `--scale attnserve=N` gives each the next port of the range
    assert port(svc["ports"][0]) == ("127.0.0.1", "8000-8009", container_port)
    assert svc["stop_signal"] == "SIGTERM"
    assert svc["init"] is True  # an init as PID 1 forwards SIGTERM and reaps


def test_the_model_is_a_read_only_mount_of_the_smollm2_export(resolved, docker_compose,
                                                             tmp_path) -> None:
    svc = resolved["services"]["attnserve"]
    default = REPO / "artifacts" / "smollm2-135m-instruct"  # what `make deploy-model` exports
    assert bind_mounts(svc)["/models/default"] == (default, True)
    assert "ARTIFACT_DIR" not in str(svc["build"])  # no model is built into the image
    other = compose_config(docker_compose, env={"ATTNSERVE_MODEL_DIR": str(tmp_path)})
    assert bind_mounts(other["services"]["attnserve"])["/models/default"] == (tmp_path, True)
    makefile = (REPO / "Makefile").read_text()
    assert f"COMPOSE_MODEL_DIR := {default.relative_to(REPO)}" in makefile
    assert "\ndeploy-model: artifact\n" in makefile


def test_every_port_binds_to_loopback_unless_asked(resolved, docker_compose) -> None:
    for name, svc in resolved["services"].items():
        assert port(svc["ports"][0])[0] == "127.0.0.1", name
    public = compose_config(docker_compose, env={"PUBLISH_ADDRESS": "0.0.0.0"})
    assert port(public["services"]["attnserve"]["ports"][0])[0] == "0.0.0.0"


def test_prometheus_and_proxy_images_build_from_debian_packages(resolved) -> None:
    for name, image in (("prometheus", "attnserve-prometheus:bookworm"),
                        ("proxy", "attnserve-haproxy:bookworm")):
        svc = resolved["services"][name]
        assert svc["image"] == image, name
        context = Path(svc["build"]["context"])
        assert context.parent == REPO / "deploy" / "images", name
        assert svc["build"]["args"] == {"BASE_IMAGE": "debian:bookworm-slim"}, name
        dockerfile = (context / "Dockerfile").read_text()
        assert "ARG BASE_IMAGE=debian:bookworm-slim" in dockerfile
        assert "apt-get install -y --no-install-recommends" in dockerfile
    build_script = (REPO / "deploy" / "images" / "build.sh").read_text()
    for image in ("attnserve:cpu", "attnserve-prometheus:bookworm", "attnserve-haproxy:bookworm"):
        assert f"build {image} " in build_script, image


def test_proxy_fronts_the_replicas_and_stops_softly(resolved) -> None:
    proxy = resolved["services"]["proxy"]
    assert proxy["profiles"] == ["scale"]
    assert proxy["depends_on"] == {"attnserve": {"condition": "service_healthy"}}
    haproxy_dir = REPO / "deploy" / "haproxy"
    assert bind_mounts(proxy)["/usr/local/etc/haproxy"] == (haproxy_dir, True)
    assert proxy["stop_signal"] == "SIGUSR1"  # HAProxy's soft stop: in-flight requests finish
    assert port(proxy["ports"][0])[1:] == ("8080", 8080)
    assert port(proxy["ports"][1]) == ("127.0.0.1", "8404", 8404)  # its stats page
    config = (haproxy_dir / "haproxy.cfg").read_text()
    assert "server-template attnserve 10 attnserve:8000" in config
    # Prefix- and adapter-aware: a consistent hash of the key the body gives.
    assert "balance hash var(txn.route_key)" in config
    assert "hash-type consistent" in config
    assert "option httpchk GET /ready" in config
    assert "retry-on conn-failure empty-response 503" in config
    errorfile = re.search(r"errorfile 503 /usr/local/etc/haproxy/(\S+)", config)
    assert errorfile, config
    page = (haproxy_dir / errorfile.group(1)).read_bytes()
    assert page.startswith(b"HTTP/1.1 503 ") and b"\r\nRetry-After: " in page
    assert page.split(b"\r\n\r\n", 1)[1].strip().startswith(b"{")


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


LORA_PASS_THROUGH = ("ATTNSERVE_LORA_MODULES", "ATTNSERVE_RUNTIME_LORA", "ATTNSERVE_MAX_LORAS",
                     "ATTNSERVE_MAX_LORA_RANK")


def test_adapters_are_a_read_only_mount_served_only_when_named(docker_compose,
                                                              tmp_path) -> None:
    default = REPO / "deploy" / "adapters"
    unset = compose_config(docker_compose, env={name: "" for name in LORA_PASS_THROUGH})
    svc = unset["services"]["attnserve"]
    assert bind_mounts(svc)["/adapters"] == (default, True)
    assert not list(default.glob("*/adapter_config.json"))  # the default holds no adapter
    # unset, nothing reaches the server: it serves no adapter and runs no adapter graph
    assert all(svc["environment"][name] in (None, "") for name in LORA_PASS_THROUGH)
    assert svc["environment"]["ATTNSERVE_LORA_DIR"] == "/adapters"  # read with runtime_lora
    named = compose_config(docker_compose, env={
        "ATTNSERVE_ADAPTERS_DIR": str(tmp_path), "ATTNSERVE_LORA_MODULES": "sql=/adapters/sql",
        "ATTNSERVE_RUNTIME_LORA": "true", "ATTNSERVE_MAX_LORAS": "8",
        "ATTNSERVE_MAX_LORA_RANK": "32"})["services"]["attnserve"]
    assert bind_mounts(named)["/adapters"] == (tmp_path, True)
    assert {name: named["environment"][name] for name in LORA_PASS_THROUGH} == {
        "ATTNSERVE_LORA_MODULES": "sql=/adapters/sql", "ATTNSERVE_RUNTIME_LORA": "true",
        "ATTNSERVE_MAX_LORAS": "8", "ATTNSERVE_MAX_LORA_RANK": "32"}


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
    assert port(gpu["ports"][0])[1] != "8000"  # runs beside the CPU service
    assert bind_mounts(gpu)["/models/default"][1] is True
    with_profile = compose_config(docker_compose, "--profile", "gpu")
    assert "attnserve-gpu" in with_profile["services"]


def test_only_the_service_and_prometheus_start_by_default(resolved) -> None:
    # Grafana's image comes only from a registry, the proxy only matters when scaled, the
    # GPU image needs a GPU: each behind its profile, so a bare `docker-compose up` starts
    # where no registry answers.
    profiles = {name: svc.get("profiles") for name, svc in resolved["services"].items()}
    assert profiles == {"attnserve": None, "prometheus": None, "attnserve-gpu": ["gpu"],
                        "proxy": ["scale"], "grafana": ["grafana"]}


def test_prometheus_mounts_config_and_rules(resolved) -> None:
    prom = resolved["services"]["prometheus"]
    assert bind_mounts(prom)["/etc/prometheus"] == (REPO / "deploy" / "prometheus", True)
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    assert (REPO / "deploy" / "prometheus" / "prometheus.yml").is_file()
    assert port(prom["ports"][0])[1:] == ("9090", 9090)


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
    assert port(graf["ports"][0])[1:] == ("3000", 3000)
