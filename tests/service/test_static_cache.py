"""StaticCacheModel (engine.onnx, in-place KV cache) drives the same Batch to the same tokens.

The reference is the plain model.onnx loop of conftest (batch 1, session.run, argmax); the
engine graph is built here from the tiny checkpoint (the test process may use torch; the
served process never does).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from service.contract import io_spec as io
from service.contract.engine_spec import ENGINE_FILE
from service.engine.batch import Batch
from service.engine.request import GenerationRequest, SamplingParams, StoppingCriteria
from service.engine.session import OnnxModel, create_model, create_session
from service.engine.static_cache import StaticCacheModel, StaticKV
from service.engine.text import TextCodec
from tests.service.conftest import run_with_joins

PROMPTS = ["ROMEO:", "First Citizen:\nBefore we proceed any further", "To be",
           "What say you, my good lord? I pray", "O"]


@pytest.fixture(scope="module")
def engine_artifact(artifact: Path, tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
                    ) -> Path:
    from export.engine_graph import export_engine
    from model.checkpoint import load_checkpoint

    out = tmp_path_factory.mktemp("engine") / "artifact"
    shutil.copytree(artifact, out)
    export_engine(load_checkpoint(tiny_checkpoint).model.eval(), out / ENGINE_FILE)
    return out


@pytest.fixture(scope="module")
def engine(engine_artifact: Path) -> StaticCacheModel:
    model = create_model(engine_artifact, io.ArtifactConfig.load(engine_artifact), "cpu", 1)
    assert isinstance(model, StaticCacheModel)
    return model


@pytest.fixture(scope="module")
def plain(artifact: Path) -> OnnxModel:
    return OnnxModel(create_session(artifact / io.MODEL_FILE, "cpu", 1),
                     io.ArtifactConfig.load(artifact))


@pytest.fixture(scope="module")
def codec(artifact: Path) -> TextCodec:
    return TextCodec.from_file(artifact / io.TOKENIZER_FILE)


def request(ids: list[int], max_new: int, prompt_logprobs: bool = False) -> GenerationRequest:
    return GenerationRequest(ids, SamplingParams(), StoppingCriteria(max_new, (), None),
                             prompt_logprobs=prompt_logprobs)


def test_batched_greedy_equals_the_reference_loop_with_joins_and_leaves(
        engine: StaticCacheModel, codec: TextCodec, encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    lengths = [12, 70, 7, 21, 66]
    requests = [request(encode(p), n) for p, n in zip(PROMPTS, lengths, strict=True)]
    waves = [requests[:2], requests[2:3], requests[3:]]
    got = run_with_joins(engine, codec, waves, join_every=4)
    for r in requests:
        assert got[r.id] == reference_greedy(r.prompt_ids, r.stopping.max_new_tokens), r.id


def test_logits_equal_model_onnx_for_left_padded_prompts_and_decode(
        engine: StaticCacheModel, plain: OnnxModel, encode: Callable[[str], list[int]]) -> None:
    prompts = [encode(PROMPTS[1]), encode(PROMPTS[2]), encode(PROMPTS[4])]
    width = max(len(p) for p in prompts)
    ids = np.zeros((3, width), np.int64)
    mask = np.zeros((3, width), np.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    pos = np.clip(mask.cumsum(1) - 1, 0, None)
    got, kv_e = engine.forward(ids, mask, pos, None, True)
    want, kv_p = plain.forward(ids, mask, pos, None, True)
    for i, p in enumerate(prompts):  # padding positions carry no meaning in either
        np.testing.assert_allclose(got[i, width - len(p):], want[i, width - len(p):], atol=1e-4)
    buffers = [b.data_ptr() for b in kv_e.buffers]
    for _ in range(5):
        nxt = want[:, -1].argmax(-1)[:, None]  # (B, 1)
        mask = np.concatenate([mask, np.ones((3, 1), np.int64)], axis=1)
        pos = pos[:, -1:] + 1
        got, kv_e = engine.forward(nxt, mask, pos, kv_e, False)
        want, kv_p = plain.forward(nxt, mask, pos, kv_p, False)
        np.testing.assert_allclose(got, want, atol=1e-4)
    # Every step wrote into the buffers allocated at prefill: no new cache, no copy.
    assert [b.data_ptr() for b in kv_e.buffers] == buffers
    assert list(kv_e.lengths) == [len(p) + 5 for p in prompts]


def test_kv_round_trip_through_left_padded_arrays(
        engine: StaticCacheModel, plain: OnnxModel, encode: Callable[[str], list[int]]) -> None:
    """kv_to_numpy gives the same left-padded cache model.onnx would hold."""
    prompts = [encode(PROMPTS[0]), encode(PROMPTS[3])]
    width = max(len(p) for p in prompts)
    ids = np.zeros((2, width), np.int64)
    mask = np.zeros((2, width), np.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    pos = np.clip(mask.cumsum(1) - 1, 0, None)
    _, kv_e = engine.forward(ids, mask, pos, None, False)
    _, kv_p = plain.forward(ids, mask, pos, None, False)
    mine, ref = engine.kv_to_numpy(kv_e), plain.kv_to_numpy(kv_p)
    for a, b in zip(mine, ref, strict=True):
        assert a.shape == b.shape
        for i, p in enumerate(prompts):
            np.testing.assert_allclose(a[i, :, width - len(p):], b[i, :, width - len(p):],
                                       atol=1e-5)


def test_create_model_falls_back_to_model_onnx(engine_artifact: Path, artifact: Path) -> None:
    config = io.ArtifactConfig.load(artifact)
    assert isinstance(create_model(artifact, config, "cpu", 1), OnnxModel)
    assert isinstance(create_model(engine_artifact, config, "cpu", 1, engine_graph=False),
                      OnnxModel)
    assert isinstance(create_model(engine_artifact, config, "cpu", 1), StaticCacheModel)


def test_prompt_logprobs_through_the_batch_match_model_onnx(
        engine: StaticCacheModel, plain: OnnxModel, codec: TextCodec,
        encode: Callable[[str], list[int]]) -> None:
    reqs = [request(encode(PROMPTS[2]), 1), request(encode(PROMPTS[1]), 1, prompt_logprobs=True)]
    got, want = (Batch.from_requests([request(r.prompt_ids, 1, r.prompt_logprobs) for r in reqs],
                                     codec, m.vocab_size, 0) for m in (engine, plain))
    got.step(engine)
    want.step(plain)
    a, b = got.sequences[1].prefill, want.sequences[1].prefill
    assert [t.id for t in a] == [t.id for t in b]
    np.testing.assert_allclose([t.logprob or 0.0 for t in a], [t.logprob or 0.0 for t in b],
                               atol=1e-4)
    assert isinstance(got.kv, StaticKV)
