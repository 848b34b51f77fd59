"""/v1/completions prompts as token ids, and echo's prompt scoring (what lm-evaluation-harness
sends: ``prompt`` a list of token-id lists, ``echo``, ``logprobs: 1``, ``max_tokens: 1``).

Checked black-box over HTTP against references written here: the greedy ORT loop for the
generations, and a plain ONNX Runtime run of model.onnx with a float64 log-softmax for every
prompt position's log-probability and top alternatives (vLLM's shape: the first token's
entry null, the others the top ``logprobs`` plus the token itself).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from tokenizers import Tokenizer

from service.contract.reference import OrtDecoder
from tests.service.helpers import ServerProcess, serving

NAME = "tiny"
TEXT = "Return the value of the"
OTHER = "def f(x):"
Encode = Callable[[str], list[int]]
Greedy = Callable[[list[int], int], list[int]]


@pytest.fixture(scope="module")
def server(artifact: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    yield from serving(artifact, tmp_path_factory.mktemp("prompts") / "server.log",
                       ("--served-model-name", NAME))


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def prompt_logprobs(artifact: Path) -> Callable[[list[int]], np.ndarray]:
    """ids → (T - 1, V) float64 log-probabilities of each next token: one plain forward of
    model.onnx over the whole prompt (no engine, no service code)."""
    dec = OrtDecoder.from_artifact(artifact)

    def run(ids: list[int]) -> np.ndarray:
        t = len(ids)
        logits, _ = dec(np.asarray([ids], np.int64), np.ones((1, t), np.int64),
                        np.arange(t, dtype=np.int64)[None, :], dec.empty_past(1))
        rows = logits[0, :-1].astype(np.float64)  # (T - 1, V): predicts tokens 1..T-1
        peak = rows.max(axis=-1, keepdims=True)
        return rows - peak - np.log(np.exp(rows - peak).sum(axis=-1, keepdims=True))

    return run


def complete(client: httpx.Client, **body: Any) -> httpx.Response:
    return client.post("/v1/completions", json={"model": NAME, **body})


def piece(tokenizer: Tokenizer, token: int) -> str:
    return str(tokenizer.decode([token], skip_special_tokens=False))


def assert_refused(r: httpx.Response, param: str, says: str) -> None:
    """OpenAI's error body, as every /v1 validation error has it."""
    assert r.status_code == 422, r.text
    assert r.json() == {"error": {"message": r.json()["error"]["message"],
                                  "type": "invalid_request_error", "code": "invalid_value",
                                  "param": param}}
    assert r.json()["error"]["message"].startswith(f"{param}: ")
    assert says in r.json()["error"]["message"]


def test_token_id_prompts_alone_and_batched_generate_the_reference_greedy_text(
        client: httpx.Client, encode: Encode, tokenizer: Tokenizer,
        reference_greedy: Greedy) -> None:
    first, second = encode(TEXT), encode(OTHER)
    expected = [str(tokenizer.decode(reference_greedy(ids, 8), skip_special_tokens=True))
                for ids in (first, second)]
    alone = complete(client, prompt=first, max_tokens=8, temperature=0)
    assert alone.status_code == 200, alone.text
    assert alone.json()["choices"][0]["text"] == expected[0]
    assert alone.json()["usage"]["prompt_tokens"] == len(first)
    batch = complete(client, prompt=[first, second], max_tokens=8, temperature=0)
    assert batch.status_code == 200, batch.text
    assert [c["text"] for c in batch.json()["choices"]] == expected
    assert batch.json()["usage"]["prompt_tokens"] == len(first) + len(second)
    texts = complete(client, prompt=[TEXT, OTHER], max_tokens=8, temperature=0)
    assert [c["text"] for c in texts.json()["choices"]] == expected


def test_token_id_prompts_are_checked_against_the_vocabulary_and_the_context(
        client: httpx.Client, encode: Encode) -> None:
    info = client.get("/info").json()
    vocab, longest = info["model_config"]["vocab_size"], info["limits"]["max_input_tokens"]
    ids = encode(TEXT)
    assert_refused(complete(client, prompt=[*ids, vocab]), f"prompt.{len(ids)}",
                   "outside the vocabulary")
    assert_refused(complete(client, prompt=[ids, [vocab]]), "prompt.1.0",
                   "outside the vocabulary")
    assert_refused(complete(client, prompt=[ids[0], -1]), "prompt.1",
                   "greater than or equal to 0")
    assert_refused(complete(client, prompt=[1] * (longest + 1)), "prompt",
                   f"exceed max_input_tokens {longest}")
    assert_refused(complete(client, prompt=[ids, [1] * (longest + 1)]), "prompt.1",
                   f"exceed max_input_tokens {longest}")
    assert_refused(complete(client, prompt=[]), "prompt", "at least 1 item")
    assert_refused(complete(client, prompt=[ids, []]), "prompt.1", "at least 1 item")
    r = complete(client, prompt=[TEXT, ids[0]])
    assert r.status_code == 422 and r.json()["error"]["param"].startswith("prompt"), r.text


def test_max_tokens_zero_with_echo_scores_the_prompt_as_vllm_does(
        client: httpx.Client, encode: Encode, tokenizer: Tokenizer,
        prompt_logprobs: Callable[[list[int]], np.ndarray]) -> None:
    ids, n = encode(TEXT), 3
    reference = prompt_logprobs(ids)  # (T - 1, V)
    r = complete(client, prompt=ids, max_tokens=0, echo=True, logprobs=n)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == tokenizer.decode(ids, skip_special_tokens=False)
    assert choice["finish_reason"] == "length"
    assert r.json()["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0,
                                 "total_tokens": len(ids)}
    lp = choice["logprobs"]
    assert lp["tokens"] == [piece(tokenizer, t) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i, token in enumerate(ids[1:], start=1):
        row = reference[i - 1]
        assert lp["token_logprobs"][i] == pytest.approx(row[token], abs=1e-4)
        best = np.argsort(-row, kind="stable")[:n]
        expected = {piece(tokenizer, int(t)): row[t] for t in best}
        expected[piece(tokenizer, token)] = row[token]  # the token itself, as vLLM adds
        top = lp["top_logprobs"][i]
        assert top.keys() == expected.keys()
        assert top == {k: pytest.approx(v, abs=1e-4) for k, v in expected.items()}
        assert top[lp["tokens"][i]] == lp["token_logprobs"][i]  # the very same number

    streamed = client.post("/v1/completions", json={
        "model": NAME, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": n,
        "stream": True})
    events = [line[len("data: "):] for line in streamed.text.splitlines()
              if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) == 2
    chunk = httpx.Response(200, content=events[0]).json()["choices"][0]
    assert (chunk["text"], chunk["logprobs"], chunk["finish_reason"]) == (
        choice["text"], lp, "length")

    assert_refused(complete(client, prompt=ids, max_tokens=0), "max_tokens", "echo")
    assert_refused(complete(client, prompt=ids, max_tokens=0, echo=True, min_tokens=1),
                   "min_tokens", "exceeds max_tokens 0")


def test_a_sampled_token_is_always_among_its_own_top_logprobs(client: httpx.Client) -> None:
    """OpenAI's rule, which vLLM follows: the chosen token's logprob is always returned, so
    ``logprobs: 1`` gives one entry where it was the most likely and two where it was not.
    Greedy decoding always picks the most likely; sampling at temperature 2 over 16 tokens
    picks another at least once (which ones depends on the host's float rounding)."""
    sizes = {}
    for temperature in (0.0, 2.0):
        r = complete(client, prompt=TEXT, max_tokens=16, temperature=temperature, seed=7,
                     logprobs=1)
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                                     strict=True):
            assert top[token] == value
            assert len(top) == (1 if value == max(top.values()) else 2)
        sizes[temperature] = {len(top) for top in lp["top_logprobs"]}
    assert sizes[0.0] == {1}
    assert 2 in sizes[2.0]


def test_lm_eval_parses_our_echo_into_the_reference_scores(
        client: httpx.Client, encode: Encode, reference_greedy: Greedy,
        prompt_logprobs: Callable[[list[int]], np.ndarray]) -> None:
    """lm-evaluation-harness's own parser on the very request it sends (token ids, echo,
    logprobs 1, max_tokens 1): each continuation's summed log-probability, and whether
    greedy decoding would produce it, for the greedy continuation and one that is not."""
    from lm_eval.models import openai_completions as completions  # a dev dependency
    context = encode(TEXT)
    greedy = reference_greedy(context, 3)
    after_context = prompt_logprobs([*context, greedy[0]])[-1]  # (V,)
    runner_up = int(np.argsort(-after_context, kind="stable")[1])
    continuations = [greedy, [runner_up, *greedy[1:]]]
    r = complete(client, prompt=[context + c for c in continuations], temperature=0,
                 max_tokens=1, logprobs=1, echo=True, seed=1234)
    assert r.status_code == 200, r.text
    parsed = completions.LocalCompletionsAPI.parse_logprobs(
        outputs=r.json(), ctxlens=[len(context)] * len(continuations))
    for (score, is_greedy), continuation in zip(parsed, continuations, strict=True):
        ids = context + continuation
        reference = prompt_logprobs(ids)
        scored = range(len(context), len(ids))
        assert score == pytest.approx(sum(reference[i - 1, ids[i]] for i in scored), abs=1e-4)
        assert is_greedy == all(reference[i - 1].argmax() == ids[i] for i in scored)
    assert [g for _, g in parsed] == [True, False]
