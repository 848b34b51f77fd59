"""/openapi.json describes the server: statuses, content types, bounds, security; and a
bounded schemathesis run over it (every check) against a live server finds nothing.

schemathesis' positive_data_acceptance check expects 2xx for schema-valid bodies; it is
told 422 is also expected, because some bounds count tokens (prompt length, prompt +
max_new_tokens ≤ max_total_tokens) or relate two fields (png renders weights only), which
JSON Schema cannot state. Every other check runs with its defaults.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.service.helpers import ServerProcess, serving

KEY = "schema-key"
NAME = "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONFIG = """[checks.positive_data_acceptance]
expected-statuses = ["2xx", "404", "422", "429"]
"""


@pytest.fixture(scope="module")
def server(artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from serving(artifact, tmp_path_factory.mktemp("openapi") / "server.log",
                       ("--served-model-name", NAME), env={"ATTNSERVE_API_KEY": KEY})


@pytest.fixture(scope="module")
def document(server: ServerProcess) -> dict[str, Any]:
    return dict(httpx.get(f"{server.url}/openapi.json", timeout=30).json())


def responses(document: dict[str, Any], path: str, method: str = "post") -> dict[str, Any]:
    return dict(document["paths"][path][method]["responses"])


def test_every_route_lists_its_real_statuses_and_content_types(document: dict[str, Any]) -> None:
    model_routes = ["/generate", "/generate_stream", "/", "/v1/completions",
                    "/v1/chat/completions"]
    for path in model_routes:
        assert {"200", "401", "413", "422", "424", "429", "503"} <= set(
            responses(document, path)), path
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = responses(document, path)
        assert set(r["200"]["content"]) == {"application/json", "text/event-stream"}
        assert r["422"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/OpenAIError")
        assert "404" in r
    gen = responses(document, "/generate_stream")
    assert set(gen["200"]["content"]) == {"text/event-stream"}
    assert gen["422"]["content"]["application/json"]["schema"]["$ref"].endswith("/TgiError")
    assert set(responses(document, "/metrics", "get")["200"]["content"]) == {"text/plain"}
    assert set(responses(document, "/attention")["200"]["content"]) == {
        "application/json", "application/octet-stream", "image/png"}
    assert "503" in responses(document, "/ready", "get")
    assert "404" in responses(document, "/v1/models/{model_id}", "get")
    # FastAPI's default 422 body (HTTPValidationError) is not what the server sends.
    assert "HTTPValidationError" not in document["components"]["schemas"]


def test_bounds_security_and_served_name_are_in_the_document(document: dict[str, Any],
                                                             artifact: Path) -> None:
    from service.contract import io_spec as io

    config = io.ArtifactConfig.load(artifact)
    schemas = document["components"]["schemas"]
    params = schemas["GenerateParameters"]["properties"]
    [top_p] = [m for m in params["top_p"]["anyOf"] if m.get("type") == "number"]
    assert top_p["exclusiveMinimum"] == 0 and top_p["maximum"] == 1
    [max_new] = [m for m in params["max_new_tokens"]["anyOf"] if m.get("type") == "integer"]
    assert max_new == {"type": "integer", "minimum": 1, "maximum": config.max_seq_len - 1}
    completion = schemas["CompletionRequest"]["properties"]
    assert completion["model"]["enum"] == [NAME]
    assert completion["presence_penalty"]["minimum"] == -2
    assert completion["presence_penalty"]["maximum"] == 2
    stop_ids = [m for m in completion["stop_token_ids"]["anyOf"] if m.get("type") == "array"]
    assert stop_ids[0]["items"]["maximum"] == config.vocab_size - 1
    assert document["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert document["paths"]["/generate"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in document["paths"]["/health"]["get"]
    event = document["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"][
        "text/event-stream"]["schema"]
    assert event["properties"]["data"]["anyOf"][0] == {"const": "[DONE]"}


@pytest.mark.parametrize("path,body,param", [
    ("/generate", {"inputs": "a", "stream": 0}, "stream"),
    ("/generate", {"inputs": "a", "parameters": {"watermark": 0}}, "parameters.watermark"),
    ("/generate", {"inputs": "a", "parameters": {"top_n_tokens": 6}},
     "parameters.top_n_tokens"),
    ("/generate", {"inputs": "a", "parameters": {"truncate": 500}}, "parameters.truncate"),
    ("/v1/completions", {"model": NAME, "prompt": "a", "seed": 2**53}, "seed"),
    ("/v1/completions", {"model": NAME, "prompt": "a", "logit_bias": {"x": 1}},
     "logit_bias.x"),
    ("/v1/completions", {"model": NAME, "prompt": "a", "max_tokens": 2.5}, "max_tokens"),
])
def test_bodies_the_schema_calls_invalid_are_rejected(server: ServerProcess, path: str,
                                                      body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert (error["param"] if path.startswith("/v1") else error.split(":")[0]) == param


def test_integral_floats_count_as_integers_like_json_schema_says(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/generate", headers=AUTH, timeout=30, json={
        "inputs": "a", "parameters": {"max_new_tokens": 3.0, "seed": 7.0, "do_sample": True,
                                      "details": True}})
    assert r.status_code == 200, r.text
    assert r.json()["details"]["generated_tokens"] == 3 and r.json()["details"]["seed"] == 7


def test_schemathesis_finds_no_failure(server: ServerProcess, document: dict[str, Any],
                                       tmp_path: Path) -> None:
    pytest.importorskip("schemathesis")
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG, "utf-8")
    # Bounded by time: 20 s (fuzzing and stateful testing repeat until the budget is spent;
    # 45 s and 90 s found nothing more and cost the suite their time); every operation is
    # still reached and every check run, as the assertions below require.
    run = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "--no-color",
         "run", f"{server.url}/openapi.json", "-H", f"Authorization: Bearer {KEY}",
         "--checks", "all", "--max-examples", "10", "--max-time", "20", "--workers", "1",
         "--seed", "1", "--generation-database", "none", "--request-timeout", "30"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    report = run.stdout + run.stderr
    assert run.returncode == 0, report[-6000:]
    operations = sum(len(ops) for ops in document["paths"].values())
    assert f"Tested: {operations}" in report and "No issues found" in report, report[-3000:]
