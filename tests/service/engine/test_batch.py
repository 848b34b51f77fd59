"""The Batch on the tiny model: batched greedy equals the plain loop, whoever joins or leaves.

The runner is model.onnx through the KV pool (model_graph_runner.py); engine.onnx drives the same
Batch in test_engine_graph_runner.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from service.artifact.text import TextCodec
from service.contract import io_spec as io
from service.contract.reference import OrtDecoder
from service.engine.batch import Batch
from service.engine.model_graph_runner import ModelGraphRunner
from service.engine.request import GenerationRequest, SamplingParams, StoppingCriteria
from service.engine.runner import PoolConfig
from service.engine.sampling import log_softmax
from service.providers import create_session
from tests.service.helpers import one_step, run_with_joins

PROMPTS = ["ROMEO:", "First Citizen:\nBefore we proceed any further", "To be",
           "What say you, my good lord? I pray", "O"]


@pytest.fixture(scope="module")
def session(artifact: Path) -> ort.InferenceSession:
    return create_session(artifact / io.MODEL_FILE, "cpu", 1)


@pytest.fixture
def model(artifact: Path, session: ort.InferenceSession) -> ModelGraphRunner:
    """A fresh pool of 8 slots over the shared session."""
    return ModelGraphRunner(session, io.ArtifactConfig.load(artifact), PoolConfig(slots=8))


@pytest.fixture(scope="module")
def codec(artifact: Path) -> TextCodec:
    return TextCodec.from_file(artifact / io.TOKENIZER_FILE)


def request(ids: list[int], max_new: int, eos: int | None = None, stop: tuple[str, ...] = (),
            prompt_logprobs: bool = False) -> GenerationRequest:
    return GenerationRequest(ids, SamplingParams(), StoppingCriteria(max_new, stop, eos),
                             prompt_logprobs=prompt_logprobs)


def new_batch(requests: list[GenerationRequest], codec: TextCodec,
              model: ModelGraphRunner) -> Batch:
    return Batch.from_requests(requests, codec, model.vocab_size)


def test_batched_greedy_equals_the_reference_loop_with_joins_and_leaves(
        model: ModelGraphRunner, codec: TextCodec, encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    lengths = [12, 30, 7, 21, 16]
    requests = [request(encode(p), n) for p, n in zip(PROMPTS, lengths, strict=True)]
    waves = [requests[:2], requests[2:3], requests[3:]]
    got = run_with_joins(model, codec, waves, join_every=4)
    for r in requests:
        assert got[r.id] == reference_greedy(r.prompt_ids, r.stopping.max_new_tokens), r.id


def test_filter_frees_the_leaving_rows_and_keeps_the_others_cache(
        model: ModelGraphRunner, codec: TextCodec, encode: Callable[[str], list[int]]) -> None:
    long_ids, short_ids = encode(PROMPTS[1]), encode(PROMPTS[2])
    batch = new_batch([request(long_ids, 3), request(short_ids, 10)], codec, model)
    generated = [[e.token.id for e in one_step(model, batch)] for _ in range(3)]
    pool = model.pool
    assert pool.used == 2 and pool.tokens_held == len(long_ids) + len(short_ids) + 4
    short = batch.slots[1]
    batch.filter([1], model)
    # Only the short row is left: its slot holds its prompt plus the two tokens fed since.
    assert batch.slots == [short] and pool.used == 1
    assert pool.lengths[short.index] == len(short_ids) + 2
    fed = [generated[0][1], generated[1][1]]
    assert pool.tokens[short.index, :len(short_ids) + 2].tolist() == [*short_ids, *fed]
    batch.release(model)
    assert pool.used == 0 and pool.tokens_held == 0


def test_stop_sequence_and_eos_end_generation(
        model: ModelGraphRunner, codec: TextCodec, encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    ids = encode(PROMPTS[0])
    expected = reference_greedy(ids, 20)
    text = codec.decode(expected)
    stop = text[5:8]
    assert stop.strip(), text
    eos = expected[3]
    batch = new_batch([request(ids, 20, stop=(stop,)), request(ids, 20, eos=eos),
                       request(ids, 2)], codec, model)
    finishes = {}
    while len(finishes) < 3:
        for i, event in enumerate(one_step(model, batch)):
            if event.finish is not None and i not in finishes:
                finishes[i] = event.finish
    at = text.find(stop)
    assert finishes[0].reason == "stop_sequence"
    assert finishes[0].generated_text == text[:at + len(stop)]
    assert finishes[0].stop_offset == at
    assert finishes[1].reason == "eos_token"
    assert finishes[1].generated_tokens == expected.index(eos) + 1
    assert finishes[2].reason == "length" and finishes[2].generated_tokens == 2


def test_prompt_logprobs_match_a_full_forward(
        model: ModelGraphRunner, codec: TextCodec, encode: Callable[[str], list[int]],
        artifact: Path) -> None:
    ids = encode(PROMPTS[1])
    short = encode(PROMPTS[2])  # shares the batch, so the long prompt's row is unpadded
    scored = GenerationRequest(ids, SamplingParams(top_n_logprobs=3), StoppingCriteria(1),
                               prompt_logprobs=True)
    batch = new_batch([request(short, 1), scored], codec, model)
    one_step(model, batch)
    prefill = batch.sequences[1].prefill
    dec = OrtDecoder.from_artifact(artifact)  # the plain loop: model.onnx by its names
    ones = np.ones((1, len(ids)), np.int64)
    logits, _ = dec(np.asarray([ids]), ones, np.arange(len(ids))[None, :], dec.empty_past(1))
    lp = log_softmax(logits[0])  # (T, V)
    assert [t.id for t in prefill] == ids
    assert prefill[0].logprob is None and prefill[0].top == ()
    np.testing.assert_allclose([t.logprob for t in prefill[1:]],
                               [lp[j, t] for j, t in enumerate(ids[1:])], atol=1e-4)
    # each position's 3 best next tokens, best first (OpenAI's echo with logprobs: 3)
    rows = logits[0].astype(np.float64)  # (T, V)
    peak = rows.max(-1, keepdims=True)
    rows = rows - peak - np.log(np.exp(rows - peak).sum(-1, keepdims=True))  # log-softmax
    for j, info in enumerate(prefill[1:]):
        best = np.argsort(-rows[j], kind="stable")[:3]
        assert {t for t, _, _ in info.top} == set(best.tolist())
        top_lp = [v for _, _, v in info.top]
        assert top_lp == sorted(top_lp, reverse=True)
        np.testing.assert_allclose(top_lp, np.sort(rows[j, best])[::-1], atol=1e-4)
        assert [text for t, text, _ in info.top] == [
            codec.tokenizer.decode([t], skip_special_tokens=False) for t, _, _ in info.top]
    assert batch.sequences[0].prefill == ()


def test_incremental_decoding_never_splits_a_character(codec: TextCodec) -> None:
    text = "a😀 ça, 你好!"
    ids = codec.encode(text)
    assert len(ids) > len(text)  # multi-byte characters span several byte tokens
    decoder = codec.decoder()
    pieces = [decoder.push(i) for i in ids]
    pieces.append(decoder.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
