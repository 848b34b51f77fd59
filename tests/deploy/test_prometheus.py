"""deploy/prometheus: promtool validates the config and rules, and unit-tests every alert.

tests/deploy/alerts_test.yml feeds synthetic series to each alert rule and states, computed
by hand, which alerts must fire (with their rendered annotations) and which must not.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PROM_DIR = REPO / "deploy" / "prometheus"


@pytest.fixture(scope="module")
def promtool(system_tool) -> str:
    return system_tool("promtool")


def run(*cmd: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=60, cwd=cwd,
                          check=False)


def test_promtool_check_config(promtool) -> None:
    proc = run(promtool, "check", "config", str(PROM_DIR / "prometheus.yml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 rule files found" in proc.stdout


def test_promtool_check_rules(promtool) -> None:
    proc = run(promtool, "check", "rules", str(PROM_DIR / "alerts.yml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 6 rules found" in proc.stdout


def test_promtool_rejects_a_broken_rule(promtool, tmp_path) -> None:
    text = (PROM_DIR / "alerts.yml").read_text()
    broken = tmp_path / "alerts.yml"
    broken.write_text(text.replace("up{job=~\"attnserve.*\"} == 0", "up{job=~\"attnserve.*\" == 0"))
    assert broken.read_text() != text
    proc = run(promtool, "check", "rules", str(broken))
    assert proc.returncode != 0


def test_alert_rules_unit_tests(promtool) -> None:
    proc = run(promtool, "test", "rules", "alerts_test.yml", cwd=Path(__file__).parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_alert_unit_tests_fail_when_a_threshold_moves(promtool, tmp_path) -> None:
    # Guard against a vacuous alerts_test.yml: loosen the error-ratio threshold so the
    # 1-in-11 series no longer fires, and the unit tests must notice.
    (tmp_path / "deploy" / "prometheus").mkdir(parents=True)
    rules = (PROM_DIR / "alerts.yml").read_text()
    assert rules.count("> 0.05") == 1
    (tmp_path / "deploy" / "prometheus" / "alerts.yml").write_text(
        rules.replace("> 0.05", "> 0.5"))
    (tmp_path / "tests" / "deploy").mkdir(parents=True)
    shutil.copy(Path(__file__).parent / "alerts_test.yml", tmp_path / "tests" / "deploy")
    proc = run(promtool, "test", "rules", "alerts_test.yml", cwd=tmp_path / "tests" / "deploy")
    assert proc.returncode != 0
    assert "AttnserveErrorRatioHigh" in proc.stdout + proc.stderr


def test_scrape_config_targets_every_replica_of_the_compose_service_every_5s() -> None:
    config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    assert config["global"]["scrape_interval"] == "5s"
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    main = jobs["attnserve"]
    assert main.get("metrics_path", "/metrics") == "/metrics"
    # DNS discovery by the service's name: one target per replica under --scale
    assert main["dns_sd_configs"] == [{"names": ["attnserve"], "type": "A", "port": 8000,
                                       "refresh_interval": "5s"}]
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    assert "attnserve" in compose["services"]
    gpu = jobs["attnserve-gpu"]["dns_sd_configs"][0]
    assert gpu["names"] == ["attnserve-gpu"] and gpu["port"] == 8000
    assert "attnserve-gpu" in compose["services"]
    assert config["rule_files"] == ["alerts.yml"]


def test_alerts_cover_latency_errors_queue_and_target_down() -> None:
    rules = yaml.safe_load((PROM_DIR / "alerts.yml").read_text())["groups"][0]["rules"]
    by_name = {rule["alert"]: rule["expr"] for rule in rules}
    assert "attnserve_e2e_request_latency_seconds_bucket" in by_name["AttnserveP99LatencyHigh"]
    assert "histogram_quantile(0.99" in by_name["AttnserveP99LatencyHigh"]
    assert 'status=~"5.."' in by_name["AttnserveErrorRatioHigh"]
    assert 'reason="queue_full"' in by_name["AttnserveQueueSaturated"]
    assert by_name["AttnserveTargetDown"].startswith("up{")
