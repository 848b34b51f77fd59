"""The API clients expect, black-box over HTTP: chat completions with the model's template,
tokenize / detokenize, sampling controls, structured output, X-Request-Id, and the official
openai and text-generation clients.

One server (torch hidden) serves a copy of the tiny artifact that carries a chat template
and a tokenizer_config.json, pinned by its manifest as export writes them.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import numpy as np
import openai
import pytest
from tokenizers import Tokenizer, models

from service.contract import io_spec as io
from service.contract.manifest import describe_files, load_manifest
from service.contract.reference import OrtDecoder
from tests.service.helpers import ServerProcess, serving

NAME = "tiny-chat"
EOS = 2  # the tiny tokenizer's <end>
Greedy = Callable[[list[int], int], list[int]]
Encode = Callable[[str], list[int]]
# Short on purpose: the tiny model's context is 128 tokens.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles are system, user and assistant') }}{% endif %}"
    "{{ m.role[0] | upper }}: {{ m.content | trim }}\n"
    "{% endfor %}{% if add_generation_prompt %}A:{% endif %}")


@pytest.fixture(scope="module")
def chat_artifact(artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("chat-artifact") / "artifact"
    shutil.copytree(artifact, out)
    (out / io.CHAT_TEMPLATE_FILE).write_text(TEMPLATE, "utf-8")
    (out / io.TOKENIZER_CONFIG_FILE).write_text(json.dumps(
        {"bos_token": "<start>", "eos_token": "<end>"}), "utf-8")
    manifest = load_manifest(out)
    names = sorted(p.name for p in out.iterdir() if p.name != io.MANIFEST_FILE)
    dataclasses.replace(manifest, files=describe_files(out, names)).write(out)
    return out


@pytest.fixture(scope="module")
def server(chat_artifact: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    yield from serving(chat_artifact, tmp_path_factory.mktemp("api") / "server.log",
                       ("--served-model-name", NAME, "--max-batch-size", "8"))


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def api(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def hf_render(messages: list[dict[str, Any]]) -> str:
    """The prompt transformers builds (the reference for what the server must render)."""
    transformers = pytest.importorskip("transformers")
    vocab = {"<unk>": 0, "<start>": 1, "<end>": 2}
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        bos_token="<start>", eos_token="<end>", chat_template=TEMPLATE)
    return str(hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=True))


CONVERSATION = [{"role": "system", "content": "Python docs."},
                {"role": "user", "content": " Return the "}]


# -- chat completions ---------------------------------------------------------------------


def test_chat_prompt_is_the_template_rendering_and_greedy_output_matches_the_reference(
        api: openai.OpenAI, encode: Encode, tokenizer: Tokenizer,
        reference_greedy: Greedy) -> None:
    prompt_ids = encode(hf_render(CONVERSATION))
    expected = reference_greedy(prompt_ids, 12)
    reply = api.chat.completions.create(model=NAME, messages=CONVERSATION,  # type: ignore[arg-type]
                                        max_tokens=12, temperature=0, logprobs=True,
                                        top_logprobs=3)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == decode(tokenizer, [t for t in expected if t != EOS])
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.usage.completion_tokens == len(expected)
    assert choice.finish_reason == ("stop" if expected[-1] == EOS else "length")
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert len(content) == len(expected)
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert entry.bytes == list(entry.token.encode())


def test_info_names_the_chat_template_and_top_logprobs_needs_logprobs(
        client: httpx.Client) -> None:
    assert client.get("/info").json()["chat_template"] == "chat_template.jinja"
    r = client.post("/v1/chat/completions", json={"model": NAME, "messages": CONVERSATION,
                                                  "top_logprobs": 2})
    assert r.status_code == 422 and r.json()["error"]["param"] == "top_logprobs"


def test_chat_streaming_with_the_openai_client_gives_the_same_text_and_usage(
        api: openai.OpenAI) -> None:
    plain = api.chat.completions.create(model=NAME, messages=CONVERSATION,  # type: ignore[arg-type]
                                        max_tokens=16, temperature=0)
    chunks = list(api.chat.completions.create(
        model=NAME, messages=CONVERSATION, max_tokens=16, temperature=0,  # type: ignore[arg-type]
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishing = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishing[-1] == plain.choices[0].finish_reason
    assert all(f is None for f in finishing[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert plain.usage is not None
    assert chunks[-1].usage.total_tokens == plain.usage.total_tokens


def test_streamed_completion_logprobs_carry_the_plain_responses_offsets(
        client: httpx.Client) -> None:
    """Streamed with logprobs, each chunk's token starts where the plain response says
    (text_offset: the characters before it), and the chunks' texts make the plain text."""
    body = {"model": NAME, "prompt": " Return the ", "max_tokens": 12, "temperature": 0,
            "logprobs": 1}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    choices = [e["choices"][0] for e in events]
    assert "".join(c["text"] for c in choices) == plain["text"]
    streamed = [c["logprobs"] for c in choices]
    assert [lp["tokens"][0] for lp in streamed] == plain["logprobs"]["tokens"]
    assert [lp["text_offset"][0] for lp in streamed] == plain["logprobs"]["text_offset"]
    assert plain["logprobs"]["text_offset"][1:] != plain["logprobs"]["text_offset"][:-1]


def test_chat_n_seed_and_stop(api: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": NAME, "messages": CONVERSATION, "max_tokens": 20,
                          "temperature": 1.0, "seed": 5, "n": 3}
    first = api.chat.completions.create(**kw)
    again = api.chat.completions.create(**kw)
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len(set(texts)) > 1  # n choices are not n copies
    full = texts[0] or ""
    stop = full[3:6]
    stopped = api.chat.completions.create(**{**kw, "n": 1, "stop": [stop]})
    assert stopped.choices[0].message.content == full[:full.find(stop)]
    assert stopped.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("messages,param", [
    ([{"role": "bot", "content": "hi"}], "messages.0.role"),
    ([], "messages"),
    ([{"role": "user"}], "messages.0.content"),
    ([{"role": "user", "content": "a", "mood": "x"}], "messages.0.mood"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
     "messages.0.content.0.type"),
    ([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}], "messages"),
])
def test_malformed_conversations_are_422_naming_the_field(
        client: httpx.Client, messages: list[Any], param: str) -> None:
    r = client.post("/v1/chat/completions", json={"model": NAME, "messages": messages})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == param


# -- tokenize / detokenize ----------------------------------------------------------------


def test_tokenize_and_detokenize_in_vllm_and_tgi_shapes(
        client: httpx.Client, encode: Encode, tokenizer: Tokenizer) -> None:
    text = "Return the value"
    r = client.post("/tokenize", json={"prompt": text, "model": NAME})
    assert r.json() == {"count": len(encode(text)), "max_model_len": 128,
                        "tokens": encode(text)}
    chat = client.post("/tokenize", json={"messages": CONVERSATION}).json()
    assert chat["tokens"] == encode(hf_render(CONVERSATION))
    tgi = client.post("/tokenize", json={"inputs": text}).json()
    assert [t["id"] for t in tgi] == encode(text)
    assert "".join(t["text"] for t in tgi) == text
    assert all(text[t["start"]:t["stop"]] == t["text"] for t in tgi)
    back = client.post("/detokenize", json={"tokens": [1, *encode(text)]}).json()
    assert back == {"prompt": "<start>" + text}
    bad = client.post("/detokenize", json={"tokens": [5, 10**6]})
    assert bad.status_code == 422 and bad.json()["error"] == (
        "tokens.1: token id 1000000 is outside the vocabulary (0..383)")
    assert client.post("/tokenize", json={"prompt": "a", "model": "other"}).status_code == 404


# -- sampling controls, black-box -------------------------------------------------------


def completion(client: httpx.Client, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/completions", json={"model": NAME, "prompt": "Return the",
                                             "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_logit_bias_forces_a_token(client: httpx.Client, tokenizer: Tokenizer) -> None:
    token = tokenizer.token_to_id("x")
    out = completion(client, max_tokens=6, logit_bias={str(token): 100})
    assert out["choices"][0]["text"] == "x" * 6
    r = client.post("/v1/completions", json={"model": NAME, "prompt": "a",
                                             "logit_bias": {"99999": 1}})
    assert r.status_code == 422 and r.json()["error"]["param"] == "logit_bias.99999"


def test_min_tokens_holds_off_eos_and_ignore_eos_runs_past_it(client: httpx.Client) -> None:
    eos_first = completion(client, max_tokens=10, logit_bias={str(EOS): 100})
    assert eos_first["usage"]["completion_tokens"] == 1
    assert eos_first["choices"][0]["finish_reason"] == "stop"
    held = completion(client, max_tokens=10, logit_bias={str(EOS): 100}, min_tokens=4)
    assert held["usage"]["completion_tokens"] == 5  # four tokens, then the end
    assert held["choices"][0]["finish_reason"] == "stop"
    ignored = completion(client, max_tokens=7, logit_bias={str(EOS): 100}, ignore_eos=True)
    assert ignored["usage"]["completion_tokens"] == 7
    assert ignored["choices"][0]["finish_reason"] == "length"
    too_many = client.post("/v1/completions", json={"model": NAME, "prompt": "a",
                                                    "max_tokens": 3, "min_tokens": 5})
    assert too_many.status_code == 422 and too_many.json()["error"]["param"] == "min_tokens"


def test_stop_token_ids_end_the_text_before_the_token(
        client: httpx.Client, encode: Encode, tokenizer: Tokenizer,
        reference_greedy: Greedy) -> None:
    expected = reference_greedy(encode("Return the"), 12)
    stop_id = expected[4]
    cut = expected.index(stop_id)
    out = completion(client, max_tokens=12, stop_token_ids=[stop_id])
    assert out["choices"][0]["text"] == decode(tokenizer, expected[:cut])
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == cut + 1


Pick = Callable[[np.ndarray, list[int]], int]


@pytest.fixture(scope="module")
def decode_with(artifact: Path) -> Callable[[list[int], int, Pick], list[int]]:
    """The plain ORT loop (no service sampling code) choosing each token with ``pick``
    from the float64 logits and the tokens so far; stops right after end-of-sequence."""
    dec = OrtDecoder.from_artifact(artifact)

    def run(prompt: list[int], steps: int, pick: Pick) -> list[int]:
        ids = np.asarray([prompt], np.int64)  # (1, T)
        total, past, out = len(prompt), dec.empty_past(1), []
        while len(out) < steps:
            pos = np.arange(total - ids.shape[1], total, dtype=np.int64)[None, :]  # (1, T)
            logits, past = dec(ids, np.ones((1, total), np.int64), pos, past)
            token = pick(logits[0, -1].astype(np.float64), out)
            out.append(token)
            if token == EOS:
                break
            ids, total = np.asarray([[token]], np.int64), total + 1
        return out

    return run


def test_presence_and_frequency_penalties_match_their_definition(
        client: httpx.Client, encode: Encode, tokenizer: Tokenizer,
        decode_with: Callable[[list[int], int, Pick], list[int]]) -> None:
    def penalised(logits: np.ndarray, out: list[int]) -> int:
        counts = np.bincount(out, minlength=logits.shape[0])  # generated tokens only
        return int(np.argmax(logits - 0.6 * counts - 1.1 * (counts > 0)))

    expected = decode_with(encode("Return the"), 24, penalised)
    out = completion(client, max_tokens=24, presence_penalty=1.1, frequency_penalty=0.6)
    assert out["choices"][0]["text"] == decode(tokenizer, expected)
    assert out["usage"]["completion_tokens"] == len(expected)


def test_min_p_one_keeps_only_the_top_token_whatever_the_temperature(
        client: httpx.Client, encode: Encode, tokenizer: Tokenizer,
        reference_greedy: Greedy) -> None:
    expected = decode(tokenizer, reference_greedy(encode("Return the"), 16))
    for seed in range(3):
        out = completion(client, max_tokens=16, temperature=2.0, seed=seed, min_p=1.0)
        assert out["choices"][0]["text"] == expected


def test_typical_p_keeps_the_token_whose_surprisal_is_closest_to_the_entropy(
        client: httpx.Client, encode: Encode,
        decode_with: Callable[[list[int], int, Pick], list[int]]) -> None:
    def most_typical(logits: np.ndarray, _: list[int]) -> int:
        logp = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
        entropy = -np.sum(np.exp(logp) * logp)
        return int(np.argmin(np.abs(-logp - entropy)))

    expected = decode_with(encode("Return the"), 12, most_typical)
    for seed in range(2):  # a tiny mass keeps exactly one token: the draw is forced
        r = client.post("/generate", json={"inputs": "Return the", "parameters": {
            "max_new_tokens": 12, "typical_p": 1e-9, "seed": seed, "details": True}})
        assert r.status_code == 200, r.text
        assert [t["id"] for t in r.json()["details"]["tokens"]] == expected


def test_tgi_top_n_tokens_in_details_and_stream(client: httpx.Client) -> None:
    body = {"inputs": "Return the", "parameters": {"max_new_tokens": 6, "top_n_tokens": 3,
                                                    "details": True}}
    details = client.post("/generate", json=body).json()["details"]
    assert len(details["top_tokens"]) == len(details["tokens"]) == 6
    for token, top in zip(details["tokens"], details["top_tokens"], strict=True):
        assert len(top) == 3
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert top[0]["id"] == token["id"]  # greedy: the chosen token is the most likely
        assert top[0]["logprob"] == pytest.approx(token["logprob"], abs=1e-5)
    with client.stream("POST", "/generate_stream", json={**body, "stream": True}) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert [e["top_tokens"] for e in events] == details["top_tokens"]


# -- structured output --------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["module", "class", "function"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                 "maxItems": 2},
    },
    "required": ["name", "kind", "ok", "tags"],
    "additionalProperties": False,
}


def test_json_schema_output_always_validates_over_many_seeds(client: httpx.Client) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "doc", "schema": SCHEMA}}
    r = client.post("/v1/chat/completions", json={
        "model": NAME, "messages": CONVERSATION, "max_tokens": 90, "temperature": 1.0,
        "seed": 0, "n": 8, "response_format": fmt})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    r2 = client.post("/v1/completions", json={
        "model": NAME, "prompt": ["Return the", "def f"], "max_tokens": 90, "seed": 100,
        "n": 6, "response_format": fmt})
    assert r2.status_code == 200, r2.text
    texts = [c["message"]["content"] for c in choices] + [c["text"] for c in
                                                           r2.json()["choices"]]
    reasons = [c["finish_reason"] for c in choices + r2.json()["choices"]]
    assert len(texts) == 20
    for text, reason in zip(texts, reasons, strict=True):
        jsonschema.validate(json.loads(text), SCHEMA)
        assert reason == "stop"  # ended because the document was complete


def test_tgi_grammar_json_and_regex(client: httpx.Client) -> None:
    for seed in range(5):
        out = client.post("/generate", json={"inputs": "Return the", "parameters": {
            "max_new_tokens": 90, "do_sample": True, "seed": seed, "details": True,
            "grammar": {"type": "json", "value": SCHEMA}}}).json()
        jsonschema.validate(json.loads(out["generated_text"]), SCHEMA)
        assert out["details"]["finish_reason"] == "eos_token"
    pattern = r"(cat|dog)-[0-9]{2,3}"
    for seed in range(5):
        out = client.post("/generate", json={"inputs": "Return the", "parameters": {
            "max_new_tokens": 20, "do_sample": True, "seed": seed,
            "grammar": {"type": "regex", "value": pattern}}}).json()
        assert re.fullmatch(pattern, out["generated_text"]), out
    bad = client.post("/generate", json={"inputs": "a", "parameters": {
        "grammar": {"type": "regex", "value": "(unclosed"}}})
    assert bad.status_code == 422
    assert bad.json()["error"].startswith("parameters.grammar.value:")


def test_constrained_and_free_requests_share_a_batch(
        client: httpx.Client, encode: Encode, tokenizer: Tokenizer,
        reference_greedy: Greedy) -> None:
    free_expected = decode(tokenizer, reference_greedy(encode("Return the"), 30))

    def free() -> str:
        return str(completion(client, max_tokens=30)["choices"][0]["text"])

    def constrained() -> str:
        return str(completion(client, max_tokens=90, response_format={"type": "json_schema",
                   "json_schema": {"schema": SCHEMA}})["choices"][0]["text"])

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(f) for f in (free, constrained, free, constrained)]
        results = [f.result() for f in futures]
    assert results[0] == results[2] == free_expected
    for text in results[1::2]:
        jsonschema.validate(json.loads(text), SCHEMA)


# -- X-Request-Id --------------------------------------------------------------------------


def test_request_id_is_echoed_or_generated_and_logged(client: httpx.Client,
                                                      server: ServerProcess) -> None:
    r = client.post("/tokenize", json={"prompt": "a"}, headers={"X-Request-Id": "trace-42"})
    assert r.headers["x-request-id"] == "trace-42"
    fresh = client.post("/tokenize", json={"prompt": "a"})
    assert len(fresh.headers["x-request-id"]) == 32
    refused = client.post("/tokenize", json={"prompt": ""}, headers={"X-Request-Id": "bad id"})
    assert refused.headers["x-request-id"] not in ("", "bad id")
    lines = [line for line in server.log().splitlines() if "[trace-42]" in line]
    assert any("POST /tokenize 200" in line for line in lines), server.log()[-2000:]


# -- Hugging Face text-generation client ----------------------------------------------------


def test_text_generation_client(server: ServerProcess, encode: Encode, tokenizer: Tokenizer,
                                reference_greedy: Greedy) -> None:
    text_generation = pytest.importorskip("text_generation")
    tgi = text_generation.Client(server.url, timeout=60)
    expected = reference_greedy(encode("Return the"), 10)
    out = tgi.generate("Return the", max_new_tokens=10, top_n_tokens=2,
                       decoder_input_details=True)
    assert out.generated_text == decode(tokenizer, expected)
    assert [t.id for t in out.details.tokens] == expected
    assert out.details.top_tokens is not None and len(out.details.top_tokens) == 10
    assert [t.id for t in out.details.prefill] == encode("Return the")
    streamed = list(tgi.generate_stream("Return the", max_new_tokens=10))
    assert [r.token.id for r in streamed] == expected
    assert streamed[-1].generated_text == out.generated_text
    assert streamed[-1].details is not None and streamed[-1].details.generated_tokens == 10
