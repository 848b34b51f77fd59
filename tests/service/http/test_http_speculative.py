"""Prompt-lookup speculation over HTTP, as a user turns it on (`--speculative-model ngram`):
greedy answers equal the plain model.onnx reference loop, and /metrics counts drafts the
way vLLM names them (accepted ≤ drafted, the per-position counts summing to the accepted).

The counts are checked on a server that proposes at every step
(`--no-speculative-adaptive`), so they do not depend on timings; the default server, whose
policy pauses by measured cost, must give the same tokens."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.service.helpers import ServerProcess, metric_value, serving

# Code repeats itself: prompt lookup finds what comes next in the prompt.
REPETITIVE = ("def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\n"
              "def add(a, b):\n    return")
PROMPTS = [REPETITIVE, "The meaning of", REPETITIVE + " a + b\n\n\ndef add(a, b):"]


def serve(artifact: Path, factory: pytest.TempPathFactory, *flags: str
          ) -> Iterator[ServerProcess]:
    yield from serving(artifact, factory.mktemp("log") / "server.log",
                       ("--speculative-model", "ngram", "--num-speculative-tokens", "3",
                        *flags))


@pytest.fixture(scope="module")
def every_step(engine_artifact: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[ServerProcess]:
    yield from serve(engine_artifact, tmp_path_factory, "--no-speculative-adaptive")


@pytest.fixture(scope="module")
def adaptive(engine_artifact: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[ServerProcess]:
    yield from serve(engine_artifact, tmp_path_factory)


def greedy_answers_equal_the_reference(
        server: ServerProcess, encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> str:
    """Each prompt alone (speculation runs at batch 1); the /metrics text after."""
    for prompt in PROMPTS:
        r = httpx.post(f"{server.url}/generate", timeout=60, json={
            "inputs": prompt, "parameters": {"max_new_tokens": 40, "details": True}})
        assert r.status_code == 200, r.text
        got = [t["id"] for t in r.json()["details"]["tokens"]]
        assert got == reference_greedy(encode(prompt), 40), prompt
    return httpx.get(f"{server.url}/metrics", timeout=10).text


def test_prompt_lookup_at_every_step_gives_the_reference_tokens_and_counts_drafts(
        every_step: ServerProcess, encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    text = greedy_answers_equal_the_reference(every_step, encode, reference_greedy)
    drafts = metric_value(text, "attnserve_spec_decode_num_drafts_total")
    drafted = metric_value(text, "attnserve_spec_decode_num_draft_tokens_total")
    accepted = metric_value(text, "attnserve_spec_decode_num_accepted_tokens_total")
    per_position = [metric_value(text, "attnserve_spec_decode_num_accepted_tokens_per_pos_total",
                                 {"position": str(i)}) for i in range(3)]
    assert drafts > 0, "prompt lookup never proposed on repetitive code"
    assert drafts <= drafted <= 3 * drafts
    assert 0 < accepted <= drafted
    assert sum(per_position) == accepted
    assert per_position == sorted(per_position, reverse=True)  # a kept draft follows a kept one
    assert metric_value(text, "attnserve_spec_decode_num_paused_steps_total") == 0


def test_the_cost_aware_policy_gives_the_reference_tokens(
        adaptive: ServerProcess, encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    text = greedy_answers_equal_the_reference(adaptive, encode, reference_greedy)
    assert "attnserve_spec_decode_num_paused_steps_total" in text
