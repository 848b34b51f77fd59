"""deploy/grafana: provisioning wired to the dashboard, and the dashboard covers the brief.

Whether every metric name in the dashboard exists is checked against a live /metrics in
test_smoke.py; here the PromQL name extraction itself is tested, and the panel set.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
GRAFANA = REPO / "deploy" / "grafana"


def dashboard() -> dict:
    return json.loads((GRAFANA / "dashboards" / "attnserve.json").read_text())


def test_promql_metric_names_skips_functions_labels_and_keywords(smoke) -> None:
    expr = ('histogram_quantile(0.99, sum by (le, route) (rate(attnserve_e2e_request_latency_'
            'seconds_bucket{route=~"/gen.*", job="x"}[$__rate_interval])))'
            ' / on(job) group_left sum without (instance) (rate(other_total[5m] offset 1m))'
            ' > bool 0.5 or vector(1) and up{job="attnserve"} == 0 unless absent(b_c:d)')
    assert smoke.promql_metric_names(expr) == {
        "attnserve_e2e_request_latency_seconds_bucket", "other_total", "up", "b_c:d"}
    assert smoke.promql_metric_names("sum(rate(x[1m])) * 1e3 + 2") == {"x"}


def test_exposed_metric_names_include_family_suffixes(smoke) -> None:
    text = ("# HELP a_requests Requests.\n# TYPE a_requests counter\n"
            'a_requests_total{route="/x",status="200"} 3.0\n'
            "# HELP a_latency_seconds L.\n# TYPE a_latency_seconds histogram\n"
            "# HELP a_running R.\n# TYPE a_running gauge\na_running 0.0\n")
    names = smoke.exposed_metric_names(text)
    assert {"a_requests_total", "a_latency_seconds_bucket", "a_latency_seconds_count",
            "a_latency_seconds_sum", "a_running"} <= names
    assert "a_running_bucket" not in names and "a_requests_bucket" not in names


def test_datasource_uid_matches_every_panel() -> None:
    datasource = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml")
                                .read_text())["datasources"][0]
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090"  # the compose service
    panels = dashboard()["panels"]
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": datasource["uid"]}
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == datasource["uid"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))


def test_dashboard_has_the_required_panels(smoke) -> None:
    panels = {p["title"]: [t["expr"] for t in p["targets"]] for p in dashboard()["panels"]}

    def uses(title_word: str, metric: str) -> bool:
        return any(title_word.lower() in title.lower()
                   and any(metric in smoke.promql_metric_names(e) for e in exprs)
                   for title, exprs in panels.items())

    assert uses("request rate", "attnserve_requests_total")
    assert uses("error rate", "attnserve_requests_total")
    assert uses("time to first token", "attnserve_time_to_first_token_seconds_bucket")
    assert uses("inter-token", "attnserve_inter_token_latency_seconds_bucket")
    assert uses("end-to-end", "attnserve_e2e_request_latency_seconds_bucket")
    assert uses("batch size", "attnserve_batch_size_count")
    assert uses("queue depth", "attnserve_num_requests_waiting")
    assert uses("running", "attnserve_num_requests_running")
    assert uses("tokens / s", "attnserve_generation_tokens_total")
    assert uses("step failures", "attnserve_step_failures_total")
    ttft = next(e for t, e in panels.items() if t.startswith("Time to first token"))
    assert [e.split(",")[0] for e in ttft] == [
        "histogram_quantile(0.5", "histogram_quantile(0.95", "histogram_quantile(0.99"]


def test_dashboard_needs_no_clicks() -> None:
    dash = dashboard()
    assert dash["uid"] == "attnserve"
    assert dash["refresh"] and dash["time"]["from"].startswith("now-")
    assert dash["templating"]["list"] == []  # no variable to pick before data shows
