"""Server lifecycle over HTTP: API key, queue limit, client disconnects, readiness, SIGTERM drain.

The servers decode with engine.onnx (the production CPU path, KV pool) and every forward
pass waits at a gate the test opens ("." one pass, "+" free, "-" hold; see
fault_runner.py), so a request is provably still decoding when the test acts on it.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Any], engine_artifact: Path) -> Any:
    server = start_server("--max-batch-size", "1", "--max-queued-requests", "1",
                          env={"ATTNSERVE_API_KEY": KEY}, gate=True, wait=False,
                          model=engine_artifact)
    server.gate.send("+")
    server.wait_ready()
    return server


@pytest.fixture
def held(server: Any) -> Iterator[Any]:
    """The server's gate, closed (the engine is idle between tests); opened again after."""
    server.gate.send("-")
    yield server.gate
    server.gate.send("+")


@pytest.fixture(scope="module")
def client(server: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def wait_for(client: httpx.Client, metric: Callable[..., float], name: str, value: float,
             labels: dict[str, str] | None = None, timeout: float = 20.0) -> None:
    """Until /metrics shows ``name{labels} == value`` (bounded): the server updates its
    metrics on its own threads, after the event the test caused."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(client.get("/metrics").text, name, labels) == value:
            return
        time.sleep(0.02)
    raise AssertionError(f"{name}{labels or ''} never reached {value} in {timeout} s")


def first_event(stream: Iterator[str]) -> dict[str, Any]:
    for line in stream:
        if line.startswith("data:"):
            return dict(json.loads(line[5:]))
    raise AssertionError("stream ended before its first event")


def test_api_key_guards_model_routes_only(server: Any, client: httpx.Client,
                                          metric: Callable[..., float]) -> None:
    before = metric(client.get("/metrics").text, "attnserve_rejected_requests_total",
                    {"reason": "unauthorized"})
    body = {"inputs": "ROMEO:", "parameters": {"max_new_tokens": 2}}
    for path, payload in (("/generate", body), ("/generate_stream", body),
                          ("/attention", {"inputs": "ROMEO:"}),
                          ("/v1/completions", {"model": "x", "prompt": "a"})):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = client.post(path, json=payload, headers=headers)
            assert r.status_code == 401, (path, headers)
            error = r.json()["error"]
            assert (error["code"] == "invalid_api_key" if path.startswith("/v1")
                    else r.json()["error_type"] == "unauthorized")
    assert client.get("/v1/models").status_code == 401
    assert client.get("/info").status_code == 401
    assert client.get("/info", headers=AUTH).json()["auth"] is True
    for path in ("/health", "/ready", "/metrics"):
        assert client.get(path).status_code == 200, path
    ok = client.post("/generate", json=body, headers=AUTH)
    assert ok.status_code == 200, ok.text
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    model = api.models.list().data[0].id
    assert api.completions.create(model=model, prompt="a", max_tokens=2).usage is not None
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope",
                      max_retries=0).models.list()
    after = metric(client.get("/metrics").text, "attnserve_rejected_requests_total",
                   {"reason": "unauthorized"})
    assert after - before == 15


def test_full_queue_answers_429_overloaded(client: httpx.Client, held: Any,
                                           metric: Callable[..., float]) -> None:
    long = {"inputs": "ROMEO:", "parameters": {"max_new_tokens": 100}}
    short = {"inputs": "ROMEO:", "parameters": {"max_new_tokens": 2}}
    before = metric(client.get("/metrics").text, "attnserve_rejected_requests_total",
                    {"reason": "queue_full"})
    with client.stream("POST", "/generate_stream", json=long, headers=AUTH) as running:
        lines = running.iter_lines()  # kept referenced: a dropped iterator closes the stream
        held.send(".")  # its prefill; its next step waits at the gate
        first_event(lines)  # the long request holds the only batch slot now
        queued: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: queued.append(
            client.post("/generate", json=short, headers=AUTH)))
        waiter.start()
        wait_for(client, metric, "attnserve_num_requests_waiting", 1)
        rejected = client.post("/generate", json=short, headers=AUTH)
        assert rejected.status_code == 429
        assert rejected.json()["error_type"] == "overloaded"
        assert set(rejected.json()) == {"error", "error_type"}
        model = client.get("/v1/models", headers=AUTH).json()["data"][0]["id"]
        v1 = client.post("/v1/completions", json={"model": model, "prompt": "a",
                                                  "max_tokens": 2}, headers=AUTH)
        assert v1.status_code == 429
        assert v1.json()["error"]["type"] == "overloaded"
        held.send("+")
    waiter.join(30)
    assert queued and queued[0].status_code == 200
    after = metric(client.get("/metrics").text, "attnserve_rejected_requests_total",
                   {"reason": "queue_full"})
    assert after - before >= 1


def test_list_longer_than_the_queue_is_422_not_429(client: httpx.Client) -> None:
    """Two inputs can never fit a queue of one: that is the client's error, not overload."""
    r = client.post("/generate", headers=AUTH, json={"inputs": ["a", "b"]})
    assert r.status_code == 422, r.text
    assert r.json() == {"error": "inputs: 2 sequences in one request exceed "
                                 "max_queued_requests 1", "error_type": "validation"}


def test_disconnected_stream_is_cancelled_and_frees_its_slot(
        client: httpx.Client, held: Any, metric: Callable[..., float]) -> None:
    before = client.get("/metrics").text
    gone = {"route": "/generate_stream", "status": "499"}
    with client.stream("POST", "/generate_stream", headers=AUTH, json={
            "inputs": "ROMEO:", "parameters": {"max_new_tokens": 100}}) as r:
        lines = r.iter_lines()
        held.send("..")
        first_event(lines)
        first_event(lines)
        text = client.get("/metrics").text
        assert metric(text, "attnserve_num_requests_running") == 1
        assert metric(text, "attnserve_kv_cache_slots_used") == 1
    # Leaving the block closes the connection mid-stream. The server counts the 499 once
    # it has seen the disconnect and cancelled the request: only then may the held step
    # run, or the engine could decode all 100 tokens before the cancel arrives.
    wait_for(client, metric, "attnserve_requests_total",
             metric(before, "attnserve_requests_total", gone) + 1, gone)
    held.send("+")
    wait_for(client, metric, "attnserve_num_requests_running", 0)
    # The gauges of one load report are set one after another: wait for this one too.
    wait_for(client, metric, "attnserve_kv_cache_slots_used", 0)
    after = client.get("/metrics").text
    generated = metric(after, "attnserve_generation_tokens_total") - metric(
        before, "attnserve_generation_tokens_total")
    assert 2 <= generated < 100
    ok = client.post("/generate", headers=AUTH, json={"inputs": "a",
                                                      "parameters": {"max_new_tokens": 2}})
    assert ok.status_code == 200  # the single slot is free again


def test_disconnected_plain_request_is_cancelled(server: Any, client: httpx.Client, held: Any,
                                                 metric: Callable[..., float]) -> None:
    before = client.get("/metrics").text
    labels = {"route": "/generate", "status": "499"}
    body = json.dumps({"inputs": "ROMEO:", "parameters": {"max_new_tokens": 100}}).encode()
    held.send(".")  # prefill only: the request is still decoding when the client gives up
    # A raw connection, so the test (not a client timeout) decides when the client leaves:
    # after the request is provably in the batch, before its next step may run.
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: test\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_for(client, metric, "attnserve_num_requests_running", 1)  # prefilled
    # Closed: once the 499 is counted the server has cancelled the request, so the held
    # step may run without it decoding on to its 100th token.
    wait_for(client, metric, "attnserve_requests_total",
             metric(before, "attnserve_requests_total", labels) + 1, labels)
    held.send("+")
    wait_for(client, metric, "attnserve_num_requests_running", 0)
    after = client.get("/metrics").text
    generated = metric(after, "attnserve_generation_tokens_total") - metric(
        before, "attnserve_generation_tokens_total")
    assert 1 <= generated < 100
    assert metric(after, "attnserve_requests_total", labels) - metric(
        before, "attnserve_requests_total", labels) == 1


def wait_refused(url: str) -> None:
    """Until the server stops accepting connections (bounded)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/health", timeout=2)
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
            return  # refused, or accepted from the backlog and closed or reset unanswered
        time.sleep(0.05)
    raise AssertionError("the server kept accepting connections after SIGTERM")


def wait_log(server: Any, text: str) -> None:
    deadline = time.monotonic() + 30
    while text not in server.log():
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.05)


def test_ready_is_503_until_warm_then_sigterm_drains_and_exits_0(
        start_server: Callable[..., Any], engine_artifact: Path) -> None:
    # The warm-up waits at the gate, so the server is up but provably not warm yet.
    server = start_server(wait=False, gate=True, model=engine_artifact)
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, server.log()
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.05)
    loading = httpx.get(f"{server.url}/ready")
    assert (loading.status_code, loading.json()) == (503, {"status": "loading"})
    early = httpx.post(f"{server.url}/generate", json={"inputs": "a"})
    assert early.status_code == 503 and early.json()["error_type"] == "unhealthy"
    server.gate.send("....")  # the warm-up: a prefill and three decode steps
    server.wait_ready()
    assert "engine.onnx" in server.log()

    with httpx.stream("POST", f"{server.url}/generate_stream", timeout=60, json={
            "inputs": "ROMEO:", "parameters": {"max_new_tokens": 6}}) as r:
        lines = r.iter_lines()
        server.gate.send(".")
        first_event(lines)
        server.proc.send_signal(signal.SIGTERM)  # while its second token waits at the gate
        wait_refused(server.url)  # no longer accepting
        server.gate.send("+")
        events = [json.loads(line[5:]) for line in lines if line.startswith("data:")]
    assert events[-1]["details"]["generated_tokens"] == 6  # the in-flight request finished
    assert server.proc.wait(timeout=30) == 0
    assert "draining" in server.log()


def test_sigterm_past_the_drain_timeout_fails_requests_with_json_errors(
        start_server: Callable[..., Any], engine_artifact: Path) -> None:
    """Requests outliving --drain-timeout get a 503 JSON body or a final SSE error event,
    not uvicorn's bare-text 500 or a cut stream, and the process still exits 0."""
    server = start_server("--drain-timeout", "0.5", gate=True, wait=False,
                          model=engine_artifact)
    server.gate.send("+")
    server.wait_ready()
    server.gate.send("-")
    long = {"inputs": "ROMEO:", "parameters": {"max_new_tokens": 100}}
    plain: list[httpx.Response] = []
    waiter = threading.Thread(target=lambda: plain.append(
        httpx.post(f"{server.url}/generate", json=long, timeout=60)))
    with httpx.stream("POST", f"{server.url}/generate_stream", json=long, timeout=60) as r:
        lines = r.iter_lines()
        server.gate.send(".")
        first_event(lines)
        waiter.start()
        deadline = time.monotonic() + 20
        while "attnserve_num_requests_running 2.0" not in httpx.get(
                f"{server.url}/metrics").text:
            assert time.monotonic() < deadline, "the plain request never started decoding"
            server.gate.send(".")  # a step at a time until the plain request has joined
            time.sleep(0.02)
        server.proc.send_signal(signal.SIGTERM)  # both wait at the gate, mid-decode
        wait_log(server, "drain timeout of 0.5s reached")
        server.gate.send("+")  # the held step ends; the loop fails what is left
        events = [json.loads(line[5:]) for line in lines if line.startswith("data:")]
    waiter.join(30)
    assert events[-1] == {"error": "the server is shutting down", "error_type": "unhealthy"}
    assert plain and plain[0].status_code == 503
    assert plain[0].json() == {"error": "the server is shutting down",
                               "error_type": "unhealthy"}
    assert server.proc.wait(timeout=30) == 0
