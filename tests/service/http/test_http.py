"""The live server over HTTP: parity, batching, streaming, OpenAI, attention, metrics, errors.

One `attnserve serve` subprocess (torch hidden) serves the tiny artifact for the module.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from io import BytesIO
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from tokenizers import Tokenizer

from service.contract import io_spec as io
from service.contract.manifest import load_manifest
from tests.service.helpers import ServerProcess, wait_metric

PROMPTS = ["ROMEO:", "First Citizen:\nBefore we proceed", "To be, or not", "KING:\nWhat",
           "O", "Good morrow, cousin"]
MAX_BODY = 8192


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Any]) -> ServerProcess:
    """Runs freely behind a step gate, so a test can hold the engine while requests queue."""
    server = start_server("--max-batch-size", "8", "--max-body-bytes", str(MAX_BODY),
                          "--served-model-name", "tiny", gate=True, wait=False)
    assert server.gate is not None
    server.gate.send("+")  # the warm-up's passes wait at the gate too
    server.wait_ready()
    return server


@pytest.fixture(scope="module")
def client(server: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=True))


def sse_events(response: httpx.Response) -> list[dict[str, Any]]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data:"):
            data = line[len("data:"):].strip()
            events.append({"done": True} if data == "[DONE]" else json.loads(data))
    return events


def test_health_ready_and_info(client: httpx.Client, artifact: Any) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").json() == {"status": "ready"}
    info = client.get("/info").json()
    assert info["model"] == "tiny"
    assert info["provider"] == "CPUExecutionProvider"
    assert info["torch_imported"] is False
    manifest = load_manifest(artifact)
    assert info["artifact"]["files"][io.MODEL_FILE] == manifest.files[io.MODEL_FILE].sha256
    config = io.ArtifactConfig.load(artifact)
    assert info["limits"]["max_total_tokens"] == config.max_seq_len
    assert info["limits"]["max_batch_size"] == 8


def test_greedy_generate_equals_the_reference_loop(
        client: httpx.Client, encode: Callable[[str], list[int]], tokenizer: Tokenizer,
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    prompt = PROMPTS[1]
    expected = reference_greedy(encode(prompt), 24)
    r = client.post("/generate", json={"inputs": prompt, "parameters": {
        "max_new_tokens": 24, "details": True, "decoder_input_details": True}})
    assert r.status_code == 200, r.text
    body = r.json()
    details = body["details"]
    assert [t["id"] for t in details["tokens"]] == expected
    assert body["generated_text"] == decode(tokenizer, expected)
    assert details["finish_reason"] == "length" and details["generated_tokens"] == 24
    assert details["seed"] is None
    assert [t["id"] for t in details["prefill"]] == encode(prompt)
    assert details["prefill"][0]["logprob"] is None
    assert all(t["logprob"] <= 0 for t in details["tokens"])
    assert r.headers["x-prompt-tokens"] == str(len(encode(prompt)))
    assert r.headers["x-generated-tokens"] == "24"
    for header in ("x-queue-time", "x-inference-time", "x-time-per-token"):
        assert int(r.headers[header]) >= 0


def test_list_inputs_give_a_list_in_order_and_full_text_on_request(
        client: httpx.Client, encode: Callable[[str], list[int]], tokenizer: Tokenizer,
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    r = client.post("/generate", json={"inputs": PROMPTS[:3], "parameters": {
        "max_new_tokens": 8, "return_full_text": True}})
    assert r.status_code == 200, r.text
    texts = [item["generated_text"] for item in r.json()]
    assert texts == [p + decode(tokenizer, reference_greedy(encode(p), 8)) for p in PROMPTS[:3]]
    assert "details" not in r.json()[0]


def test_concurrent_requests_are_batched_and_each_equals_its_sequential_result(
        server: ServerProcess, client: httpx.Client, metric: Callable[..., float]) -> None:
    def generate(prompt: str) -> str:
        r = client.post("/generate", json={"inputs": prompt,
                                           "parameters": {"max_new_tokens": 100}})
        assert r.status_code == 200, r.text
        return str(r.json()["generated_text"])

    sequential = [generate(p) for p in PROMPTS]
    before = client.get("/metrics").text
    # Requests sent at once may still reach the engine one after another on a busy
    # machine. So the first one is held mid-decode while the others queue behind it: all
    # of them join its batch, whatever the machine's speed.
    gate = server.gate
    assert gate is not None
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        gate.send("-")
        try:
            first = pool.submit(generate, PROMPTS[0])
            gate.send(".")  # its prefill; its first decode step waits at the gate
            wait_metric(server, "attnserve_num_requests_running", 1)
            rest = [pool.submit(generate, p) for p in PROMPTS[1:]]
            # the loop is held inside a step: nobody is admitted until the gate opens
            wait_metric(server, "attnserve_num_requests_waiting", len(rest))
        finally:
            gate.send("+")
        concurrent = [first.result(), *(f.result() for f in rest)]
    after = client.get("/metrics").text
    assert concurrent == sequential
    name = "attnserve_batch_size_bucket"
    steps = metric(after, "attnserve_batch_size_count") - metric(
        before, "attnserve_batch_size_count")
    single = metric(after, name, {"le": "1.0"}) - metric(before, name, {"le": "1.0"})
    assert steps - single > 0, "no decode step held more than one sequence"


def test_truncate_keeps_the_last_prompt_tokens(
        client: httpx.Client, encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    ids = encode(PROMPTS[1])
    r = client.post("/generate", json={"inputs": PROMPTS[1], "parameters": {
        "max_new_tokens": 5, "truncate": 4, "details": True}})
    assert r.headers["x-prompt-tokens"] == "4"
    assert [t["id"] for t in r.json()["details"]["tokens"]] == reference_greedy(ids[-4:], 5)


def test_seeded_sampling_is_reproducible(client: httpx.Client) -> None:
    params = {"max_new_tokens": 20, "do_sample": True, "temperature": 1.5, "seed": 99,
              "details": True}
    first = client.post("/generate", json={"inputs": "ROMEO:", "parameters": params}).json()
    again = client.post("/generate", json={"inputs": "ROMEO:", "parameters": params}).json()
    assert first["generated_text"] == again["generated_text"]
    assert first["details"]["seed"] == 99


def test_stop_sequences_end_generation(client: httpx.Client, tokenizer: Tokenizer,
                                       encode: Callable[[str], list[int]],
                                       reference_greedy: Callable[[list[int], int],
                                                                  list[int]]) -> None:
    full = decode(tokenizer, reference_greedy(encode("ROMEO:"), 30))
    stop = full[6:9]
    r = client.post("/generate", json={"inputs": "ROMEO:", "parameters": {
        "max_new_tokens": 30, "stop": [stop], "details": True}}).json()
    assert r["details"]["finish_reason"] == "stop_sequence"
    assert r["generated_text"] == full[:full.find(stop) + len(stop)]


def test_generate_stream_sends_one_event_per_token_then_the_result(
        client: httpx.Client, encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    expected = reference_greedy(encode(PROMPTS[2]), 12)
    with client.stream("POST", "/generate_stream", json={
            "inputs": PROMPTS[2], "parameters": {"max_new_tokens": 12}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert [e["token"]["id"] for e in events] == expected
    assert [e["index"] for e in events] == list(range(1, 13))
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    last = events[-1]
    assert last["generated_text"] == "".join(e["token"]["text"] for e in events)
    assert last["details"]["finish_reason"] == "length"
    assert last["details"]["generated_tokens"] == 12
    assert last["details"]["input_length"] == len(encode(PROMPTS[2]))


def test_openai_client_plain_and_streaming(
        server: Any, encode: Callable[[str], list[int]], tokenizer: Tokenizer,
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in api.models.list().data] == ["tiny"]
    expected = decode(tokenizer, reference_greedy(encode(PROMPTS[0]), 16))
    plain = api.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16,
                                   temperature=0, logprobs=2)
    choice = plain.choices[0]
    assert choice.text == expected and choice.finish_reason == "length"
    assert plain.usage is not None
    assert (plain.usage.prompt_tokens, plain.usage.completion_tokens) == (
        len(encode(PROMPTS[0])), 16)
    assert choice.logprobs is not None and len(choice.logprobs.token_logprobs or []) == 16
    assert all(len(t) == 2 for t in choice.logprobs.top_logprobs or [])

    chunks = list(api.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16,
                                         temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"

    stop = expected[4:7]
    stopped = api.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16,
                                     temperature=0, stop=[stop])
    assert stopped.choices[0].text == expected[:expected.find(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = api.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16,
                                      temperature=0, stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected[:expected.find(stop)]


def test_attention_json_shapes_rows_and_causality(client: httpx.Client,
                                                   encode: Callable[[str], list[int]],
                                                   artifact: Any) -> None:
    config = io.ArtifactConfig.load(artifact)
    text = "To be, or not to be"
    t = len(encode(text))
    r = client.post("/attention", json={"inputs": text,
                                        "include": ["weights", "scaled_scores", "q"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [tok["id"] for tok in body["tokens"]] == encode(text)
    shape = [config.n_layers, config.n_heads, t, t]
    assert body["shapes"] == {"weights": shape, "scaled_scores": shape,
                              "q": [config.n_layers, config.n_heads, t, config.head_dim]}
    weights = np.asarray(body["attention"]["weights"])
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
    upper = np.triu(np.ones((t, t), dtype=bool), k=1)
    assert np.all(weights[..., upper] == 0.0)
    scaled = body["attention"]["scaled_scores"]
    nulls = np.array([[[[v is None for v in row] for row in h] for h in layer]
                      for layer in scaled])
    assert np.array_equal(nulls, np.broadcast_to(upper, nulls.shape))  # -inf ↔ null
    filled = np.array([[[[-math.inf if v is None else v for v in row] for row in h]
                        for h in layer] for layer in scaled])
    softmax = np.exp(filled - filled.max(-1, keepdims=True))
    np.testing.assert_allclose(softmax / softmax.sum(-1, keepdims=True), weights, atol=1e-5)

    some = client.post("/attention", json={"inputs": text, "layers": [1], "heads": [2, 0]})
    picked = np.asarray(some.json()["attention"]["weights"])
    assert some.json()["shapes"]["weights"] == [1, 2, t, t]
    np.testing.assert_allclose(picked, weights[[1]][:, [2, 0]], atol=1e-6)


def test_attention_npz_and_png(client: httpx.Client, encode: Callable[[str], list[int]]) -> None:
    text = "Good morrow"
    t = len(encode(text))
    as_json = np.asarray(client.post("/attention", json={"inputs": text}).json()
                         ["attention"]["weights"])
    r = client.post("/attention", json={"inputs": text, "format": "npz",
                                        "include": ["weights", "scaled_scores", "k"]})
    assert r.status_code == 200
    archive = np.load(BytesIO(r.content), allow_pickle=False)
    np.testing.assert_allclose(archive["weights"], as_json, atol=1e-6)
    assert np.isneginf(archive["scaled_scores"][0, 0, 0, 1])
    assert archive["token_ids"].tolist() == encode(text)
    assert archive["tokens"].shape == (t,)
    png = client.post("/attention", json={"inputs": text, "format": "png", "layers": [0]})
    assert png.status_code == 200 and png.headers["content-type"] == "image/png"
    image = Image.open(BytesIO(png.content))
    assert image.format == "PNG" and image.width > image.height > t


def test_metrics_follow_the_traffic(client: httpx.Client, metric: Callable[..., float],
                                    encode: Callable[[str], list[int]]) -> None:
    before = client.get("/metrics").text
    r = client.post("/generate", json={"inputs": PROMPTS[3], "parameters": {
        "max_new_tokens": 9}})
    assert r.status_code == 200
    after = client.get("/metrics").text

    def delta(name: str, labels: dict[str, str] | None = None) -> float:
        return metric(after, name, labels) - metric(before, name, labels)

    assert delta("attnserve_requests_total", {"route": "/generate", "status": "200"}) == 1
    assert delta("attnserve_e2e_request_latency_seconds_count", {"route": "/generate"}) == 1
    assert delta("attnserve_generation_tokens_total") == 9
    assert delta("attnserve_prompt_tokens_total") == len(encode(PROMPTS[3]))
    assert delta("attnserve_time_to_first_token_seconds_count") == 1
    assert delta("attnserve_request_queue_time_seconds_count") == 1
    assert delta("attnserve_inter_token_latency_seconds_count") == 8
    assert delta("attnserve_prefill_duration_seconds_count") == 1
    assert delta("attnserve_decode_step_duration_seconds_count") == 8
    assert metric(after, "attnserve_num_requests_running") == 0
    assert metric(after, "attnserve_num_requests_waiting") == 0
    assert metric(after, "attnserve_kv_cache_tokens") == 0
    assert metric(after, "attnserve_model_info", {"model": "tiny",
                                                  "provider": "CPUExecutionProvider"}) == 1
    for name in ("attnserve_kv_cache_usage_perc", "attnserve_rejected_requests_total"):
        assert f"# TYPE {name.removesuffix('_total')}" in after


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package "
                    "prometheus) is not installed; the parser test above still runs")
def test_exposition_passes_promtool(client: httpx.Client) -> None:
    text = client.get("/metrics").text
    check = subprocess.run(["promtool", "check", "metrics"], input=text, text=True,
                           capture_output=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


BAD_PARAMETERS = [
    ({"inputs": ""}, "inputs"),
    ({"inputs": 5}, "inputs"),
    ({"inputs": ["ok", ""]}, "inputs.1"),
    ({"inputs": "a", "parameters": {"temperature": 0}}, "parameters.temperature"),
    ({"inputs": "a", "parameters": {"temperature": -1.0}}, "parameters.temperature"),
    ({"inputs": "a", "parameters": {"top_p": 0}}, "parameters.top_p"),
    ({"inputs": "a", "parameters": {"top_p": 1.5}}, "parameters.top_p"),
    ({"inputs": "a", "parameters": {"top_k": -1}}, "parameters.top_k"),
    ({"inputs": "a", "parameters": {"repetition_penalty": 0}}, "parameters.repetition_penalty"),
    ({"inputs": "a", "parameters": {"max_new_tokens": "5"}}, "parameters.max_new_tokens"),
    ({"inputs": "a", "parameters": {"max_new_tokens": 0}}, "parameters.max_new_tokens"),
    ({"inputs": "a", "parameters": {"best_of": 2}}, "parameters.best_of"),
    ({"inputs": "a", "unknown": 1}, "unknown"),
    ({"inputs": "a", "parameters": {"max_new_tokens": 100000}}, "parameters.max_new_tokens"),
    ({"inputs": "word " * 200}, "inputs"),  # over max_input_tokens
    ({"inputs": "word " * 20, "parameters": {"max_new_tokens": 120}},
     "parameters.max_new_tokens"),  # input + max_new_tokens over max_total_tokens
]


@pytest.mark.parametrize(("body", "field"), BAD_PARAMETERS)
def test_invalid_generate_requests_get_422_naming_the_field(
        client: httpx.Client, body: dict[str, Any], field: str) -> None:
    r = client.post("/generate", json=body)
    assert r.status_code == 422, r.text
    error = r.json()
    assert set(error) == {"error", "error_type"} and error["error_type"] == "validation"
    assert error["error"].startswith(f"{field}:"), error


def test_nan_temperature_and_broken_json_are_422(client: httpx.Client) -> None:
    headers = {"content-type": "application/json"}
    nan = client.post("/generate", headers=headers,
                      content=b'{"inputs": "a", "parameters": {"temperature": NaN}}')
    assert nan.status_code == 422 and nan.json()["error"].startswith("parameters.temperature")
    broken = client.post("/generate", headers=headers, content=b'{"inputs": ')
    assert broken.status_code == 422 and broken.json()["error_type"] == "validation"


def test_oversized_body_is_413_and_counted(client: httpx.Client,
                                           metric: Callable[..., float]) -> None:
    before = metric(client.get("/metrics").text, "attnserve_rejected_requests_total",
                    {"reason": "too_large"})
    big = client.post("/generate", json={"inputs": "x" * (MAX_BODY + 1)})
    assert big.status_code == 413
    assert big.json()["error_type"] == "too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit applies while reading
        yield b'{"inputs": "'
        for _ in range(MAX_BODY // 1000 + 1):
            yield b"y" * 1000
        yield b'"}'

    chunked = client.post("/generate", content=chunks(),
                          headers={"content-type": "application/json"})
    assert chunked.status_code == 413
    after = metric(client.get("/metrics").text, "attnserve_rejected_requests_total",
                   {"reason": "too_large"})
    assert after - before == 2


def test_openai_routes_use_openai_error_bodies(server: Any, client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "a",
                                             "temperature": 3})
    assert r.status_code == 422
    error = r.json()["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert error["param"] == "temperature"
    missing = client.post("/v1/completions", json={"model": "nope", "prompt": "a"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.UnprocessableEntityError):
        api.completions.create(model="tiny", prompt="a", top_p=0)
    assert client.get("/nowhere").json()["error_type"] == "not_found"


def test_attention_rejects_bad_layers_heads_and_formats(client: httpx.Client) -> None:
    for body, field in (({"inputs": "a", "layers": [99]}, "layers"),
                        ({"inputs": "a", "heads": [0, 0]}, "heads"),
                        ({"inputs": "a", "format": "gif"}, "format"),
                        ({"inputs": "a", "include": ["alpha"]}, "include.0"),
                        ({"inputs": "a", "format": "png", "include": ["q"]}, "include")):
        r = client.post("/attention", json=body)
        assert r.status_code == 422, body
        assert r.json()["error"].startswith(f"{field}:"), r.json()


@pytest.mark.parametrize(("path", "body", "needle"), [
    ("/generate", {"inputs": []}, "inputs: List should have at least 1 item"),
    ("/v1/completions", {"model": "tiny", "prompt": []}, "prompt: List should have at least"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "stop": ["x"] * 5},
     "stop: List should have at most 4 items"),
])
def test_union_field_errors_name_the_broken_constraint(
        client: httpx.Client, path: str, body: dict[str, Any], needle: str) -> None:
    """str | list fields: an empty or over-long list is not "should be a valid string"."""
    r = client.post(path, json=body)
    assert r.status_code == 422
    error = r.json()["error"]
    message = error["message"] if path.startswith("/v1") else error
    assert message.startswith(needle), r.json()


@pytest.mark.parametrize(("content", "why"), [
    (b'{"inputs": "\xff\xfe"}', "it is not UTF-8 text"),
    (b'{"inputs": ' + b"[" * 3000 + b"]" * 3000 + b"}", "it is nested too deeply"),
])
def test_unparsable_body_is_422_saying_why(client: httpx.Client, content: bytes,
                                           why: str) -> None:
    r = client.post("/generate", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert r.json() == {"error": f"body is not valid JSON: {why}", "error_type": "validation"}


def test_more_sequences_than_the_queue_holds_is_422_not_429(client: httpx.Client) -> None:
    """64 prompts x n=3 can never fit the default queue of 128: retrying cannot help."""
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": ["a"] * 64, "n": 3,
                                             "max_tokens": 1})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == "n"
    assert "exceed max_queued_requests 128" in r.json()["error"]["message"]


def test_seeded_n_choices_differ_and_repeat(client: httpx.Client) -> None:
    body = {"model": "tiny", "prompt": "ROMEO:", "max_tokens": 16, "temperature": 1.0,
            "seed": 11}
    texts = [c["text"] for c in client.post("/v1/completions", json={**body, "n": 2}
                                            ).json()["choices"]]
    again = [c["text"] for c in client.post("/v1/completions", json={**body, "n": 2}
                                            ).json()["choices"]]
    single = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert texts == again  # reproducible
    assert texts[0] == single  # the first choice is the plain seeded sample
    assert texts[0] != texts[1]  # not n copies of one sample
