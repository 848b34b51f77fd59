"""Sliding-window attention in the engine (Mistral's and Gemma 3's window layers: each
position sees its last 5), where
it is easiest to get wrong: prompt chunks riding in decode steps over a cache longer than
the window, and prompts resumed from the prefix cache; greedy tokens against transformers'
own MistralForCausalLM and Gemma3ForCausalLM."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from service.artifact.text import TextCodec
from service.contract import engine_spec as es
from service.contract import io_spec as io
from service.engine.batch import Batch
from service.engine.engine_graph_runner import EngineGraphRunner
from service.engine.request import GenerationRequest, SamplingParams, StoppingCriteria
from service.engine.runner import PoolConfig
from service.engine.step import Step, run_step
from service.providers import create_session
from tests.hf_llama import load_hf_model
from tests.service.helpers import one_step, run_with_joins


@pytest.fixture(scope="module", params=["mistral", "gemma3"])
def mistral(request: pytest.FixtureRequest, llama_artifacts: Any) -> Any:
    """Mistral (every layer windowed) and Gemma 3 (a window layer, then a global one)."""
    build = llama_artifacts(request.param)
    assert io.ArtifactConfig.load(build.artifact).n_layers == 2
    return build


@pytest.fixture(scope="module")
def reference(mistral: Any) -> Any:
    hf = load_hf_model(mistral.hf_dir)
    assert hf.config.sliding_window == 5

    def greedy(prompt: list[int], n: int) -> list[int]:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0)
        return [int(t) for t in out[0, len(prompt):]]

    return greedy


def runner_for(build: Any, prefix_blocks: int = 0) -> EngineGraphRunner:
    config = io.ArtifactConfig.load(build.artifact)
    return EngineGraphRunner(create_session(build.artifact / es.ENGINE_MIXED_FILE, "cpu", 1),
                             config, PoolConfig(slots=6, prefix_block_size=4,
                                                prefix_cache_blocks=prefix_blocks))


def request(ids: list[int], n: int) -> GenerationRequest:
    return GenerationRequest(ids, SamplingParams(), StoppingCriteria(n, (), None))


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 400, n).tolist()


def test_prompt_chunks_riding_in_decode_steps_see_only_the_window(mistral: Any,
                                                                   reference: Any) -> None:
    runner = runner_for(mistral)
    codec = TextCodec.from_file(mistral.artifact / io.TOKENIZER_FILE)
    assert runner.mixes_chunks
    short, long = prompt(1, 7), prompt(2, 23)
    running = Batch.from_requests([request(short, 24)], codec, runner.vocab_size)
    tokens = [one_step(runner, running)[0].token.id]
    chunked = Batch.from_requests([request(long, 10)], codec, runner.vocab_size)
    chunked.reserve(runner, top=True)
    out: list[int] = []
    while chunked.prompt_left > 0:  # chunks of 4 tokens: each over a cache past the window
        step = run_step(runner, Step().add(runner, running).add(runner, chunked, chunk=4))
        (row, chunk) = step.rows
        out = [e.token.id for e in chunk.events]
        tokens.append(row.events[0].token.id)
    merged = Batch.concatenate([running, chunked], runner)
    while len(out) < 10:
        events = one_step(runner, merged)
        tokens.append(events[0].token.id)
        out.append(events[1].token.id)
    assert out == reference(long, 10)
    assert tokens == reference(short, len(tokens))


def test_prompts_resumed_from_the_prefix_cache_see_only_the_window(mistral: Any,
                                                                    reference: Any) -> None:
    runner = runner_for(mistral, prefix_blocks=32)
    codec = TextCodec.from_file(mistral.artifact / io.TOKENIZER_FILE)
    shared = prompt(3, 16)  # four blocks, longer than the window
    first, second = request(shared + prompt(4, 3), 8), request(shared + prompt(5, 6), 8)
    got = run_with_joins(runner, codec, [[first]], join_every=1)
    got |= run_with_joins(runner, codec, [[second]], join_every=1)
    assert runner.prefix is not None and runner.prefix.counters.hits >= 16
    for r in (first, second):
        assert got[r.id] == reference(r.prompt_ids, 8), r.id
