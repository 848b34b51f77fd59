"""/attention admission over HTTP: a flood beyond the bound is answered 429 and counted,
while a token stream started at the same time completes with the reference tokens.

The server allows one /attention request at a time and none waiting. The launcher's
attention gate (tests/service/launch_server.py) holds the first request inside the
attention session until the test releases it, so "the slot is taken" is a fact the test
arranged, not a race it hopes to win.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

FLOOD = 8
HELD_TEXT = "Return a new list containing all items from the iterable in ascending order."
STREAM_PROMPT = "The module provides"
STREAM_TOKENS = 16


def in_thread(fn: Callable[[], Any], timeout: float = 60.0) -> Any:
    """fn() in a daemon thread, so a FIFO that is never opened fails the test, not hangs it."""
    done = threading.Event()
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # re-raised in the test thread
            out["error"] = exc
        finally:
            done.set()

    threading.Thread(target=target, daemon=True).start()
    assert done.wait(timeout), f"{fn} did not finish in {timeout}s"
    if "error" in out:
        raise out["error"]
    return out["value"]


class HeldRequest:
    """An /attention request sent in the background and parked inside the session."""

    def __init__(self, url: str, gate: Path, body: dict[str, Any]) -> None:
        self.gate = gate
        self.response: httpx.Response | None = None
        self.thread = threading.Thread(target=self._send, args=(url, body), daemon=True)
        self.thread.start()
        in_thread(lambda: (gate / "entered").read_text())  # it is inside attention.run now

    def _send(self, url: str, body: dict[str, Any]) -> None:
        self.response = httpx.post(f"{url}/attention", json=body, timeout=120.0)

    def release(self) -> httpx.Response:
        in_thread(lambda: (self.gate / "release").write_text("1"))
        self.thread.join(60.0)
        assert self.response is not None, "the held request never answered"
        return self.response


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Any], attention_gate: Path) -> Any:
    return start_server(env={"ATTNSERVE_ATTENTION_MAX_CONCURRENT": "1",
                             "ATTNSERVE_ATTENTION_MAX_QUEUED": "0",
                             "ATTNSERVE_ATTENTION_THREADS": "1",
                             "ATTNSERVE_TEST_ATTENTION_GATE": str(attention_gate)})


async def _stream_tokens(client: httpx.AsyncClient) -> list[int]:
    tokens = []
    async with client.stream("POST", "/generate_stream", json={
            "inputs": STREAM_PROMPT, "parameters": {"max_new_tokens": STREAM_TOKENS}}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                event = json.loads(line[len("data:"):])
                assert "error" not in event, event
                tokens.append(event["token"]["id"])
    return tokens


async def _flood_and_stream(url: str) -> tuple[list[httpx.Response], httpx.Response,
                                               list[int]]:
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as client:
        flood = [client.post("/attention", json={"inputs": f"{HELD_TEXT} ({i})"})
                 for i in range(FLOOD)]
        invalid = client.post("/attention", json={"inputs": HELD_TEXT, "layers": [99]})
        *refused, bad, tokens = await asyncio.gather(*flood, invalid, _stream_tokens(client))
    return refused, bad, tokens


def test_flood_beyond_the_bound_gets_429_counted_while_a_stream_completes(
        server: Any, attention_gate: Path, metric: Callable[..., float],
        encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    def scrape() -> str:
        return httpx.get(f"{server.url}/metrics").text

    running = {"route": "/attention", "state": "running"}
    busy = {"reason": "attention_busy"}
    before = metric(scrape(), "attnserve_rejected_requests_total", busy)

    held = HeldRequest(server.url, attention_gate,
                       {"inputs": HELD_TEXT, "include": ["weights", "q"]})
    assert metric(scrape(), "attnserve_admission_requests", running) == 1
    refused, bad, tokens = asyncio.run(_flood_and_stream(server.url))

    # The stream finished while the attention slot was still taken, with the tokens of a
    # plain ONNX Runtime greedy loop.
    assert held.thread.is_alive()
    assert tokens == reference_greedy(encode(STREAM_PROMPT), STREAM_TOKENS)
    for r in refused:
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1"
        body = r.json()
        assert set(body) == {"error", "error_type"} and body["error_type"] == "overloaded"
        assert "/attention" in body["error"]
    # Validation comes before admission: a bad field is still a 422 naming it.
    assert bad.status_code == 422 and bad.json()["error_type"] == "validation"
    assert "layers" in bad.json()["error"]
    text = scrape()
    assert metric(text, "attnserve_rejected_requests_total", busy) - before == FLOOD
    assert metric(text, "attnserve_rejected_requests_total", {"reason": "queue_full"}) == 0

    response = held.release()
    assert response.status_code == 200, response.text
    n = len(encode(HELD_TEXT))
    assert response.json()["shapes"]["weights"][2:] == [n, n]
    assert metric(scrape(), "attnserve_admission_requests", running) == 0

    # The slot came back: the next request is admitted and answered.
    again = HeldRequest(server.url, attention_gate, {"inputs": HELD_TEXT})
    assert again.release().status_code == 200
    assert metric(scrape(), "attnserve_rejected_requests_total", busy) - before == FLOOD


def test_the_openapi_document_lists_the_429(server: Any) -> None:
    responses = httpx.get(f"{server.url}/openapi.json").json()["paths"]["/attention"]["post"][
        "responses"]
    assert responses["429"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/TgiError")
