"""int8 (MatMulNBits and dynamic) and float16 artifacts through joins and leaves: batched
greedy equals the plain loop.

Each variant is compared with the plain ONNX Runtime loop (conftest.greedy_loop) over the
same artifact's model.onnx, so the reference shares the variant's weights and cache dtype
but none of the service's batching, padding or KV pool.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from service.artifact.text import TextCodec
from service.contract import io_spec as io
from service.engine.engine import EngineConfig, create_runner
from service.engine.model_graph_runner import ModelGraphRunner
from service.engine.request import GenerationRequest, SamplingParams, StoppingCriteria
from tests.service.helpers import greedy_loop, run_with_joins

PROMPTS = ["ROMEO:", "First Citizen:\nBefore we proceed any further", "To be",
           "What say you, my good lord? I pray", "O"]


@pytest.fixture(scope="module", params=["int8", "int8-dynamic", "float16"])
def variant(request: pytest.FixtureRequest, tiny_checkpoint: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Path:
    from export.to_onnx import export_artifact
    from tests.conftest import torch_threads

    out = tmp_path_factory.mktemp(request.param) / "artifact"
    options = ({"quantize": request.param} if request.param.startswith("int8")
               else {"dtype": "float16"})
    with torch_threads(1):
        return export_artifact(tiny_checkpoint, out, verify=False,
                               **options)  # type: ignore[arg-type]


def requests_for(encode: Callable[[str], list[int]]) -> list[GenerationRequest]:
    lengths = [12, 30, 7, 21, 16]
    return [GenerationRequest(encode(p), SamplingParams(), StoppingCriteria(n))
            for p, n in zip(PROMPTS, lengths, strict=True)]


def test_variant_served_alone_equals_the_plain_loop(
        variant: Path, encode: Callable[[str], list[int]]) -> None:
    config = io.ArtifactConfig.load(variant)
    model = create_runner(variant, config, EngineConfig(intra_op_threads=1))
    codec = TextCodec.from_file(variant / io.TOKENIZER_FILE)
    reference = greedy_loop(variant)
    for r in requests_for(encode):
        got = run_with_joins(model, codec, [[r]], join_every=1)
        assert got[r.id] == reference(r.prompt_ids, r.stopping.max_new_tokens), r.id


def test_variant_greedy_with_joins_and_leaves_equals_the_plain_loop(
        variant: Path, encode: Callable[[str], list[int]]) -> None:
    config = io.ArtifactConfig.load(variant)
    model = create_runner(variant, config, EngineConfig(intra_op_threads=1))
    assert isinstance(model, ModelGraphRunner)  # no engine.onnx: model.onnx through the pool
    codec = TextCodec.from_file(variant / io.TOKENIZER_FILE)
    requests = requests_for(encode)
    got = run_with_joins(model, codec, [requests[:2], requests[2:3], requests[3:]],
                         join_every=4)
    reference = greedy_loop(variant)
    for r in requests:
        assert got[r.id] == reference(r.prompt_ids, r.stopping.max_new_tokens), r.id


def test_a_rows_logits_do_not_depend_on_its_neighbour(
        variant: Path, encode: Callable[[str], list[int]]) -> None:
    """A prompt's logits are the same alone and beside another prompt. int8-dynamic
    quantised activations with one scale over the whole (B*T, d) tensor until each row got
    its own (export/quantize/dynamic_rows.py); MatMulNBits (int8: per-block scales within a row) and
    float16 never shared one. Plain ORT runs of model.onnx by its names, equal-length
    prompts (no padding), batch of 1 against batch of 2."""
    import numpy as np

    from service.contract.reference import OrtDecoder

    dec = OrtDecoder.from_artifact(variant)
    a, b = encode(PROMPTS[1]), encode(PROMPTS[3])
    n = min(len(a), len(b))
    ids = np.array([a[:n], b[:n]], np.int64)  # (2, n)
    mask = np.ones_like(ids)
    pos = np.broadcast_to(np.arange(n), ids.shape).astype(np.int64)
    alone, _ = dec(ids[:1], mask[:1], pos[:1], dec.empty_past(1))  # (1, n, V)
    paired, _ = dec(ids, mask, pos, dec.empty_past(2))  # (2, n, V)
    change = float(np.abs(paired[0].astype(np.float32) - alone[0].astype(np.float32)).max())
    assert change < 1e-4, change
