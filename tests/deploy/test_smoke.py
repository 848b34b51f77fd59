"""Smoke test of the deployment, without a container engine.

The service is started exactly as the runtime image starts it: the CMD and the ATTNSERVE_*
ENV of deploy/Dockerfile's last stage, parsed from the Dockerfile, with only the artifact path
(the session's tiny artifact instead of /models/default) and host/port (127.0.0.1 and port 0
instead of 0.0.0.0:8000) replaced. Both the service and Prometheus bind port 0 and the test
reads the port each got from its startup log: a port picked by the test and bound by the
process later could be taken by another process in between. Then a real Prometheus (Debian
package) runs deploy/prometheus/prometheus.yml with only the target changed (a static address
for the DNS discovery of compose's service name), traffic goes in, and the Prometheus HTTP API
must show the target up and a numeric p50 time to first token.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
WAIT_S = 60.0
# The only values of the image's environment the local run replaces.
REPLACED = ("ATTNSERVE_MODEL", "ATTNSERVE_HOST", "ATTNSERVE_PORT")
# The startup lines that name the port the kernel gave each process.
UVICORN_LISTENING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")
PROMETHEUS_LISTENING = re.compile(r'msg="Listening on" address=127\.0\.0\.1:(\d+)')


@dataclass
class Proc:
    url: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path
    env: dict[str, str]

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""


def stop(proc: subprocess.Popen[bytes], timeout: float = 40.0) -> int:
    """SIGTERM, then SIGKILL after `timeout` s; always reaps the process we started."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def start(cmd: list[str], env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)


def bound_port(proc: subprocess.Popen[bytes], log: Path, listening: re.Pattern[str],
               smoke: ModuleType) -> int:
    """The port `proc` (started on port 0) reports listening on in its log (bounded wait)."""
    def reported() -> int | None:
        text = log.read_text(errors="replace") if log.exists() else ""
        if (match := listening.search(text)) is not None:
            return int(match.group(1))
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}:\n{text[-3000:]}")
        return None

    return smoke.wait_until(reported, WAIT_S, f"{proc.args[0]} to report its port",
                            interval=0.1)


def alive_probe(proc: Proc, probe):
    def check():
        if proc.proc.poll() is not None:
            raise RuntimeError(f"{proc.proc.args[0]} exited with {proc.proc.returncode}:\n"
                               f"{proc.log_tail()}")
        return probe()
    return check


@pytest.fixture(scope="module")
def container_run(cpu_stages, smoke) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of the CPU runtime stage, straight from deploy/Dockerfile."""
    runtime = cpu_stages[-1]
    return smoke.container_command(runtime), smoke.stage_env(runtime)


@contextmanager
def running_service(container_run: tuple[list[str], dict[str, str]], artifact: Path,
                    smoke: ModuleType, work: Path) -> Iterator[Proc]:
    """The service as the image runs it, ready; stopped however the caller ends."""
    argv, image_env = container_run
    assert set(REPLACED) <= set(image_env), "the image must set what we replace"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSERVE_")}
    # PATH stays the host's: /opt/venv/bin of the image is this interpreter's bin here.
    env.update({k: v for k, v in image_env.items() if k != "PATH"})
    env.update({"ATTNSERVE_MODEL": str(artifact), "ATTNSERVE_HOST": "127.0.0.1",
                "ATTNSERVE_PORT": "0"})
    executable = Path(sys.executable).parent / argv[0]
    assert executable.is_file(), f"{argv[0]} is not installed next to {sys.executable}"
    log = work / "service.log"
    popen = start([str(executable), *argv[1:]], env, work, log)
    try:
        port = bound_port(popen, log, UVICORN_LISTENING, smoke)
        # What the image's HEALTHCHECK reads: the port the service really listens on.
        env["ATTNSERVE_PORT"] = str(port)
        proc = Proc(f"http://127.0.0.1:{port}", port, popen, log, env)
        smoke.wait_until(alive_probe(proc, lambda: smoke.is_ready(proc.url)), WAIT_S,
                         f"{proc.url}/ready")
        yield proc
    finally:
        stop(popen)


@pytest.fixture(scope="module")
def service(container_run, tiny_artifact, smoke, tmp_path_factory) -> Iterator[Proc]:
    # cwd like the image's: no source tree in it
    with running_service(container_run, tiny_artifact, smoke,
                         tmp_path_factory.mktemp("service-cwd")) as proc:
        yield proc


@pytest.fixture
def own_service(container_run, tiny_artifact, smoke, tmp_path_factory) -> Iterator[Proc]:
    """A service of the test's own, for a test that ends it: the module's one must outlive
    that test whatever order the tests run in."""
    with running_service(container_run, tiny_artifact, smoke,
                         tmp_path_factory.mktemp("service-cwd")) as proc:
        yield proc


@pytest.fixture(scope="module")
def prometheus(service, system_tool, tmp_path_factory, smoke) -> Iterator[Proc]:
    binary = system_tool("prometheus")
    work = tmp_path_factory.mktemp("prometheus")
    config_dir = work / "config"
    shutil.copytree(DEPLOY / "prometheus", config_dir)  # alerts.yml sits next to the config
    config = config_dir / "prometheus.yml"
    parsed = yaml.safe_load(config.read_text())
    (job,) = [j for j in parsed["scrape_configs"] if j["job_name"] == "attnserve"]
    # compose's DNS answers `attnserve` there; here the one target is the local service
    assert job.pop("dns_sd_configs")[0]["names"] == ["attnserve"]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{service.port}"]}]
    config.write_text(yaml.safe_dump(parsed, sort_keys=False))
    log = work / "prometheus.log"
    popen = start([binary, f"--config.file={config}", f"--storage.tsdb.path={work / 'data'}",
                   "--web.listen-address=127.0.0.1:0"], dict(os.environ), work, log)
    try:
        port = bound_port(popen, log, PROMETHEUS_LISTENING, smoke)
    except BaseException:
        stop(popen, timeout=15)
        raise
    proc = Proc(f"http://127.0.0.1:{port}", port, popen, log, {})

    def ready() -> bool | None:
        status, _ = smoke.http_request(f"{proc.url}/-/ready", timeout=5)
        return True if status == 200 else None

    try:
        smoke.wait_until(alive_probe(proc, ready), WAIT_S, "Prometheus /-/ready")
        yield proc
    finally:
        stop(proc.proc, timeout=15)


def test_the_container_command_is_what_runs(container_run, service) -> None:
    argv, image_env = container_run
    assert argv == ["attnserve", "serve"]
    assert Path(service.proc.args[0]).name == argv[0] and service.proc.args[1:] == argv[1:]
    for key, value in image_env.items():
        if key != "PATH" and key not in REPLACED:
            assert service.env[key] == value, key


def test_prometheus_scrapes_the_service_and_sees_ttft(service, prometheus, smoke) -> None:
    summary = smoke.check_deployment(service.url, prometheus.url, n_requests=5, timeout=WAIT_S)
    assert summary["health"] == "up"
    assert summary["target"] == f"{service.url}/metrics"
    assert math.isfinite(summary["ttft_p50_s"]) and summary["ttft_p50_s"] > 0
    assert smoke.scalar_result(prometheus.url, 'up{job="attnserve"}') == 1.0
    # check_deployment waited for a scrape that began after the last reply, and for its
    # samples to be stored: Prometheus holds every token of the 5 requests (>= 1 each).
    generated = smoke.scalar_result(prometheus.url, "max(attnserve_generation_tokens_total)")
    assert generated is not None and generated >= 5, generated


def test_alert_rules_are_loaded_and_evaluate(prometheus, smoke) -> None:
    def evaluated() -> list | None:
        groups = smoke.prometheus_api(prometheus.url, "rules")["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return rules if rules and all(r.get("health") == "ok" for r in rules) else None

    rules = smoke.wait_until(evaluated, WAIT_S, "every alert rule to evaluate without error")
    assert {r["name"] for r in rules} == {
        "AttnserveTargetDown", "AttnserveP99LatencyHigh", "AttnserveP99TimeToFirstTokenHigh",
        "AttnserveErrorRatioHigh", "AttnserveQueueSaturated", "AttnserveEngineStepsFailing"}
    for name in ("AttnserveTargetDown", "AttnserveEngineStepsFailing"):  # no step failed
        assert next(r for r in rules if r["name"] == name)["state"] == "inactive"


def test_dashboard_queries_are_valid_promql(prometheus, smoke) -> None:
    queries = smoke.dashboard_queries()
    assert len(queries) >= 15
    for expr in queries:
        # Grafana substitutes $__rate_interval; Prometheus must accept the rest as is.
        smoke.prometheus_api(prometheus.url, "query",
                             query=expr.replace("$__rate_interval", "1m"))


def test_dashboard_and_alert_metrics_exist_in_live_metrics(service, smoke) -> None:
    status, raw = smoke.http_request(f"{service.url}/metrics")
    assert status == 200
    exposed = smoke.exposed_metric_names(raw.decode())
    used = {name for expr in smoke.dashboard_queries() + smoke.alert_rule_queries()
            for name in smoke.promql_metric_names(expr)}
    assert {"attnserve_time_to_first_token_seconds_bucket", "attnserve_requests_total",
            "attnserve_num_requests_waiting", "up"} <= used
    missing = sorted(used - exposed - {"up"})  # `up` is Prometheus' own series
    assert not missing, f"not exposed by the service: {missing}"


def test_image_healthcheck_command(service, cpu_stages, smoke) -> None:
    argv = smoke.healthcheck_command(cpu_stages[-1])
    python = [sys.executable, *argv[1:]]
    ok = subprocess.run(python, env=service.env, capture_output=True, timeout=30, check=False)
    assert ok.returncode == 0, ok.stderr
    # A port bound here but not listening refuses connections, and no other process can
    # start listening on it while the check runs.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        nobody = {**service.env, "ATTNSERVE_PORT": str(closed.getsockname()[1])}
        down = subprocess.run(python, env=nobody, capture_output=True, timeout=30, check=False)
    assert down.returncode != 0


def test_sigterm_shuts_down_cleanly_within_the_grace_period(own_service: Proc) -> None:
    # docker stop / Kubernetes send SIGTERM and wait the grace period (30 s in compose).
    service = own_service
    drain = float(service.env["ATTNSERVE_DRAIN_TIMEOUT"])
    service.proc.send_signal(signal.SIGTERM)
    try:
        code = service.proc.wait(drain + 10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {drain + 10:.0f} s after SIGTERM:\n{service.log_tail()}")
    assert code == 0, service.log_tail()
    assert "Traceback" not in service.log_tail()
