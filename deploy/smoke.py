"""Smoke-test an attnserve deployment: traffic in, latency metrics out through Prometheus.

Usage:
    python deploy/smoke.py [--service http://127.0.0.1:8000] [--prometheus http://127.0.0.1:9090]
                           [--requests 5] [--timeout 60] [--api-key KEY]

Run it against `docker compose up`: it waits for /ready, sends a few /generate requests,
waits until Prometheus has scraped them, and checks that the attnserve target is up, that the
p50 time to first token is a number, and that every metric the Grafana dashboard and the
alert rules use is exposed by the service. Exit status 0 when all hold.

Standard library only, so it runs anywhere. tests/deploy/test_smoke.py reuses these functions
against a local service and a local Prometheus started exactly as the containers start them;
the Dockerfile parsing below is what lets that test take the command from the Dockerfile.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

DEPLOY_DIR = Path(__file__).resolve().parent
DASHBOARD = DEPLOY_DIR / "grafana" / "dashboards" / "attnserve.json"
ALERT_RULES = DEPLOY_DIR / "prometheus" / "alerts.yml"
TTFT_P50_QUERY = (
    "histogram_quantile(0.5, sum(rate(attnserve_time_to_first_token_seconds_bucket[1m])) by (le))"
)
T = TypeVar("T")

# ---------------------------------------------------------------------------------- Dockerfile


@dataclass
class Instruction:
    keyword: str  # upper-case: FROM, RUN, ENV, CMD, ...
    args: str  # the rest of the logical line, continuations joined


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None


def parse_dockerfile(path: Path) -> list[Stage]:
    """Split a Dockerfile into stages of instructions (comments dropped, `\\` lines joined)."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # comment lines inside a continuation are ignored by Docker too
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    if pending:
        raise ValueError(f"{path}: dangling line continuation at the end")
    stages: list[Stage] = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            words = args.split()
            words = [w for w in words if not w.startswith("--platform")]
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=words[0], name=name))
        elif keyword == "ARG" and not stages:
            continue  # global build args before the first FROM
        elif not stages:
            raise ValueError(f"{path}: {keyword} before the first FROM")
        else:
            stages[-1].instructions.append(Instruction(keyword, args))
    return stages


def exec_form(args: str) -> list[str]:
    """The JSON array of an exec-form CMD/ENTRYPOINT/HEALTHCHECK CMD; ValueError if shell form."""
    try:
        value = json.loads(args)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value) or not value:
        raise ValueError(f"not an exec-form (JSON array) command: {args!r}")
    return value


def stage_env(stage: Stage) -> dict[str, str]:
    """ENV values set in a stage, in order (`ENV K=V K2="v 2"` and legacy `ENV K V`)."""
    env: dict[str, str] = {}
    for inst in stage.all("ENV"):
        words = shlex.split(inst.args)
        if words and "=" not in words[0]:
            env[words[0]] = " ".join(words[1:])
            continue
        for word in words:
            key, sep, value = word.partition("=")
            if not sep:
                raise ValueError(f"ENV word without '=': {word!r}")
            env[key] = value
    return env


def container_command(stage: Stage) -> list[str]:
    """ENTRYPOINT + CMD of the stage, both required in exec form."""
    entry = stage.last("ENTRYPOINT")
    cmd = stage.last("CMD")
    if cmd is None:
        raise ValueError("the stage has no CMD")
    return (exec_form(entry.args) if entry else []) + exec_form(cmd.args)


def healthcheck_command(stage: Stage) -> list[str]:
    """The exec-form command of HEALTHCHECK [options] CMD [...]."""
    inst = stage.last("HEALTHCHECK")
    if inst is None:
        raise ValueError("the stage has no HEALTHCHECK")
    _, sep, command = inst.args.partition(" CMD ")
    if not sep:
        raise ValueError(f"HEALTHCHECK without CMD: {inst.args!r}")
    return exec_form(command.strip())


# ---------------------------------------------------------------------------------- PromQL

_PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
    "and", "or", "unless", "inf", "nan", "atan2",
}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (functions, keywords, labels left out)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range and subquery windows
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # Grafana variables
    names = set()
    for match in re.finditer(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", text):
        word, call = match.group(1), match.group(2)
        if call or word.lower() in _PROMQL_WORDS or re.fullmatch(r"[0-9.e+-]+", word):
            continue
        names.add(word)
    return names


def dashboard_queries(path: Path = DASHBOARD) -> list[str]:
    """Every PromQL `expr` in the dashboard's panels (rows' nested panels included)."""
    dash = json.loads(path.read_text(encoding="utf-8"))
    exprs: list[str] = []

    def walk(panels: Iterable[dict[str, Any]]) -> None:
        for panel in panels:
            exprs.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))
            walk(panel.get("panels", []))

    walk(dash.get("panels", []))
    return exprs


def alert_rule_queries(path: Path = ALERT_RULES) -> list[str]:
    """The `expr` of every rule in the alert rules file (needs PyYAML)."""
    import yaml

    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    return [rule["expr"] for group in doc["groups"] for rule in group["rules"]]


_SUFFIXES: dict[str, tuple[str, ...]] = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
    "info": ("_info",),
}


def exposed_metric_names(exposition: str) -> set[str]:
    """Selectable series names in a /metrics text: sample names plus each family's suffixes."""
    names: set[str] = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(maxsplit=3)
            names.add(family)
            names.update(family + s for s in _SUFFIXES.get(kind.strip(), ()))
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


# ---------------------------------------------------------------------------------- HTTP


def http_request(url: str, body: dict[str, Any] | None = None, api_key: str | None = None,
                 timeout: float = 30.0) -> tuple[int, bytes]:
    """(status, body) of a GET, or of a JSON POST when `body` is given; never raises on 4xx/5xx."""
    headers = {"Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def wait_until(probe: Callable[[], T | None], timeout: float, what: str,
               interval: float = 0.5) -> T:
    """Call `probe` until it returns non-None; TimeoutError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = probe()
            if value is not None:
                return value
        except (OSError, ValueError) as exc:  # connection refused, bad JSON while starting
            last_error = exc
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_error})" if last_error else ""
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}{detail}")
        time.sleep(interval)


def is_ready(service: str) -> bool | None:
    status, _ = http_request(f"{service}/ready", timeout=5)
    return True if status == 200 else None


def send_generate(service: str, n: int, api_key: str | None = None,
                  max_new_tokens: int = 8) -> list[dict[str, Any]]:
    """POST `n` TGI-style /generate requests; every one must answer 200 with generated_text."""
    replies = []
    for i in range(n):
        body = {"inputs": f"Smoke test {i}: the", "parameters": {"max_new_tokens": max_new_tokens}}
        status, raw = http_request(f"{service}/generate", body, api_key=api_key, timeout=60)
        if status != 200:
            raise RuntimeError(f"/generate answered {status}: {raw[:300]!r}")
        reply = json.loads(raw)
        if not isinstance(reply.get("generated_text"), str):
            raise RuntimeError(f"/generate reply has no generated_text: {reply}")
        replies.append(reply)
    return replies


def prometheus_api(prometheus: str, path: str, **params: str) -> Any:
    """`data` of a Prometheus HTTP API call; RuntimeError when the API reports an error."""
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    status, raw = http_request(f"{prometheus}/api/v1/{path}{query}", timeout=10)
    reply = json.loads(raw)
    if status != 200 or reply.get("status") != "success":
        raise RuntimeError(f"Prometheus {path} {params}: {status} {reply.get('error', raw[:300])}")
    return reply["data"]


def scrape_state(prometheus: str, job: str) -> dict[str, Any] | None:
    """The active target of `job` once it has been scraped at least once, else None."""
    targets = prometheus_api(prometheus, "targets", state="active")["activeTargets"]
    for target in targets:
        if target["labels"].get("job") == job and target.get("health") != "unknown":
            return target
    return None


def prometheus_now(prometheus: str) -> float:
    """Prometheus's own clock, in seconds since the epoch: the evaluation time of an instant
    query (the time a scrape is stamped with is on this clock, not on ours)."""
    return float(prometheus_api(prometheus, "query", query="time()")["result"][0])


def rfc3339_seconds(text: str) -> float:
    """Seconds since the epoch of an RFC 3339 time as Prometheus writes one (`lastScrape`:
    nanoseconds, `Z` or an offset), which datetime.fromisoformat reads only from 3.11."""
    match = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)",
                         text)
    if match is None:
        raise ValueError(f"not an RFC 3339 time: {text!r}")
    whole, fraction, zone = match.groups()
    stamp = datetime.fromisoformat(whole + ("+00:00" if zone == "Z" else zone))
    return stamp.timestamp() + float(f"0.{fraction or 0}")


def scalar_result(prometheus: str, expr: str) -> float | None:
    """The single value of an instant query, None when empty or NaN."""
    result = prometheus_api(prometheus, "query", query=expr)["result"]
    if not result:
        return None
    value = float(result[0]["value"][1])
    return None if math.isnan(value) else value


# ---------------------------------------------------------------------------------- the check


def check_deployment(service: str, prometheus: str, n_requests: int = 5, timeout: float = 60.0,
                     api_key: str | None = None, job: str = "attnserve") -> dict[str, Any]:
    """Traffic → scrape → query. Returns what it measured; raises on the first failed check."""
    wait_until(lambda: is_ready(service), timeout, f"{service}/ready to answer 200")
    first = wait_until(lambda: scrape_state(prometheus, job), timeout,
                       f"Prometheus to scrape job {job!r}")
    if first["health"] != "up":
        raise RuntimeError(f"target {first['scrapeUrl']} is {first['health']}: "
                           f"{first.get('lastError')}")
    replies = send_generate(service, n_requests, api_key=api_key)
    # Every reply is in: a scrape that begins later sees all of the traffic (one that merely
    # follows the first scrape may have begun while the requests still ran).
    traffic_end = prometheus_now(prometheus)

    def scraped_after_traffic() -> dict[str, Any] | None:
        target = scrape_state(prometheus, job)
        if target is None or rfc3339_seconds(target["lastScrape"]) <= traffic_end:
            return None
        # ... and its samples are queryable: they are stored with the target's `up` sample.
        up = f'timestamp(up{{job="{job}",instance="{target["labels"]["instance"]}"}})'
        stamp = scalar_result(prometheus, up)
        return target if stamp is not None and stamp > traffic_end else None

    target = wait_until(scraped_after_traffic, timeout,
                        f"a scrape that began after the traffic ended (at {traffic_end:.3f} s "
                        f"on Prometheus's clock)")
    if target["health"] != "up":
        raise RuntimeError(f"target {target['scrapeUrl']} went {target['health']}: "
                           f"{target.get('lastError')}")
    ttft_p50 = wait_until(lambda: scalar_result(prometheus, TTFT_P50_QUERY), timeout,
                          "a non-NaN p50 time to first token in Prometheus")
    status, raw = http_request(f"{service}/metrics", timeout=10)
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}")
    exposed = exposed_metric_names(raw.decode())
    wanted = {n for e in dashboard_queries() for n in promql_metric_names(e)} - {"up"}
    missing = sorted(wanted - exposed)
    if missing:
        raise RuntimeError(f"dashboard metrics the service does not expose: {missing}")
    return {"target": target["scrapeUrl"], "health": target["health"], "requests": len(replies),
            "ttft_p50_s": ttft_p50, "dashboard_metrics": len(wanted)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--service", default="http://127.0.0.1:8000")
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per wait")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--job", default="attnserve", help="Prometheus job of the service")
    args = parser.parse_args(argv)
    try:
        summary = check_deployment(args.service.rstrip("/"), args.prometheus.rstrip("/"),
                                   args.requests, args.timeout, args.api_key, args.job)
    except (OSError, RuntimeError, TimeoutError, ValueError) as exc:
        print(f"smoke: FAILED: {exc}", file=sys.stderr)
        return 1
    print("smoke: OK " + json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
