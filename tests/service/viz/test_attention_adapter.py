"""The attention dump under a LoRA adapter (service/viz/attention_model.py): attention_lora.onnx,
cut per request like attention.onnx, fed one adapter's A and B from the engine's AdapterSet.

Reference: the adapter merged into the base (`attnserve merge`), exported, and its
attention.onnx run by plain ONNX Runtime with the same fetches. The adapter is PEFT's own
(random A and B, rank 8 on all seven projections), never attnserve's trainer. Its weights
reach the attention model three ways, each checked: read at load and not yet placed in a
slot, copied out of the slot it sits in, and read again from its directory after an
eviction.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from service.contract import io_spec as io
from service.contract.adapter_spec import lora_file
from service.engine.adapters import AdapterSet, UnknownAdapter
from service.engine.engine import EngineConfig, add_startup_adapters, create_runner
from service.providers import create_session
from service.viz.attention_model import AttentionModel
from service.viz.look_inside import LookInside
from tests.service.lora_build import LoraBuild, held

KINDS = ["weights", "scores", "q", "v"]
# float32: x·(W + s·BA) against x·W + s·(x·Aᵀ)·B, summed in another order; scores reach
# ±10, so their error is a few float32 steps of that
TOL = {"weights": 1e-5, "scores": 5e-5, "q": 2e-5, "v": 2e-5}


@dataclass
class Build:
    artifact: Path  # the base, with attention_lora.onnx
    adapters: dict[str, Path]  # name → PEFT adapter directory
    merged: ort.InferenceSession  # alpha merged into the base: its attention.onnx


@pytest.fixture(scope="module")
def build(lora_build: LoraBuild) -> Build:
    """The session's tiny Llama and PEFT adapters (tests/service/lora_build.py), with alpha
    merged by `attnserve merge`: its attention.onnx is the reference."""
    if not (lora_build.artifact / lora_file(io.ATTENTION_FILE)).is_file():
        pytest.fail("the llama artifact has no attention_lora.onnx")
    return Build(lora_build.artifact, lora_build.adapters,
                 ort.InferenceSession(str(lora_build.merged["alpha"] / io.ATTENTION_FILE),
                                      providers=["CPUExecutionProvider"]))


def engine_adapters(build: Build) -> AdapterSet:
    """The AdapterSet a server with both adapters and one slot holds (max rank 8)."""
    config = EngineConfig(lora_modules=tuple(f"{n}={d}" for n, d in build.adapters.items()),
                          max_loras=1, max_lora_rank=8, max_batch_size=4)
    runner = create_runner(build.artifact, io.ArtifactConfig.load(build.artifact), config)
    add_startup_adapters(runner.adapters, config)
    assert runner.adapters is not None
    return runner.adapters


def attention_model(build: Build, adapters: AdapterSet | None) -> AttentionModel:
    source = build.artifact / io.ATTENTION_FILE
    return AttentionModel(create_session(source, "cpu", 1, prepack=False),
                          io.ArtifactConfig.load(build.artifact), source, adapters)


def merged_run(build: Build, ids: list[int], layers: list[int]) -> dict[str, np.ndarray]:
    """{kind: (len(layers), heads, T, ...)} from the merged model's attention.onnx."""
    x = np.asarray([ids], np.int64)
    names = [io.attention_output_name(i, k) for k in KINDS for i in layers]
    values = build.merged.run(names, {io.INPUT_IDS: x, io.ATTENTION_MASK: np.ones_like(x),
                                      io.POSITION_IDS: np.arange(len(ids))[None, :]})
    n = len(layers)
    return {k: np.concatenate(values[j * n:(j + 1) * n]) for j, k in enumerate(KINDS)}


def check(got: dict[str, np.ndarray], want: dict[str, np.ndarray], how: str) -> None:
    for kind in KINDS:
        np.testing.assert_allclose(got[kind], want[kind], rtol=0, atol=TOL[kind],
                                   err_msg=f"{kind}, adapter weights {how}")


def test_attention_under_an_adapter_is_the_merged_models(build: Build) -> None:
    adapters = engine_adapters(build)
    config = io.ArtifactConfig.load(build.artifact)
    ids = list(range(5, 29))
    layers = [config.n_layers - 1, 0]
    want = merged_run(build, ids, layers)

    model = attention_model(build, adapters)
    assert model.applies_adapters
    base = model.run(ids, KINDS, layers)
    assert model._lora is None  # the adapter graph's session waits for an adapter request
    built = model.sessions_built
    # read at load, not yet in a slot
    check(model.run(ids, KINDS, layers, adapter="alpha"), want, "as read at load")
    assert model._lora is not None and model.sessions_built == built + 1  # cut too
    # the base is unchanged, and the adapter changed it
    again = model.run(ids, KINDS, layers)
    for kind in KINDS:
        np.testing.assert_array_equal(again[kind], base[kind])
    assert np.abs(base["weights"] - want["weights"]).max() > 1e-3
    assert np.abs(base["q"] - want["q"]).max() > 1e-3

    # in its slot: the rows copied out; the engine then evicts it for beta, rewriting the
    # slot in place, and the copy taken before is untouched
    alpha = held(adapters, "alpha")
    model = attention_model(build, adapters)
    check(model.run(ids, KINDS, layers, adapter="alpha"), want, "copied from the slot")
    kept = {k: v.copy() for k, v in model._adapter_inputs[alpha.id].items()}
    adapters.release(alpha)
    held(adapters, "beta")
    assert adapters.resident() == {"beta": 1}
    for name, value in model._adapter_inputs[alpha.id].items():
        np.testing.assert_array_equal(value, kept[name])
    check(model.run(ids, KINDS, layers, adapter="alpha"), want, "kept from the slot")

    # evicted: read again from its directory
    model = attention_model(build, adapters)
    check(model.run(ids, KINDS, layers, adapter="alpha"), want, "read after an eviction")
    beta = model.run(ids, KINDS, layers, adapter="beta")
    assert np.abs(beta["weights"] - want["weights"]).max() > 1e-3
    with pytest.raises(UnknownAdapter):
        model.run(ids, KINDS, layers, adapter="gamma")


def test_without_adapters_served_the_model_applies_none(build: Build) -> None:
    model = attention_model(build, None)
    assert not model.applies_adapters


def test_the_logit_lens_under_an_adapter_is_the_merged_models(build: Build) -> None:
    """attention_lora.onnx carries attention.onnx's lens and norms; under the adapter they
    are the merged model's (the residual stream after each adapted block)."""
    config = io.ArtifactConfig.load(build.artifact)
    ids, layers = list(range(5, 29)), [config.n_layers - 1, 0]
    inside = LookInside(("logit_lens", "residual_norms"), top_k=4, target=9)
    model = attention_model(build, engine_adapters(build))
    assert model.looks_inside
    _, got = model.look(ids, ["weights"], layers, "alpha", inside)
    _, base = model.look(ids, ["weights"], layers, None, inside)
    x = np.asarray([ids], np.int64)
    names = inside.outputs(layers)
    values = build.merged.run(names, {io.INPUT_IDS: x, io.ATTENTION_MASK: np.ones_like(x),
                                      io.POSITION_IDS: np.arange(len(ids))[None, :]}
                              | inside.feeds())
    want = inside.collect(dict(zip(names, values, strict=True)), layers, config.n_layers,
                          config.n_heads)
    assert set(got) == set(want) == {"residual_norms", "logit_lens.top_ids",
                                     "logit_lens.top_probs", "logit_lens.target_probs",
                                     "logit_lens.target_ranks"}
    np.testing.assert_allclose(got["residual_norms"], want["residual_norms"], rtol=1e-5)
    np.testing.assert_allclose(got["logit_lens.top_probs"], want["logit_lens.top_probs"],
                               atol=1e-5)
    np.testing.assert_allclose(got["logit_lens.target_probs"],
                               want["logit_lens.target_probs"], atol=1e-5)
    assert np.abs(base["residual_norms"] - want["residual_norms"]).max() > 1e-3


def test_a_control_vector_under_an_adapter_is_the_merged_models_steered(build: Build) -> None:
    """attention_lora.onnx takes attention.onnx's steer: under an adapter and a control
    vector the maps and the residual norms are the merged model's under the same rows."""
    config = io.ArtifactConfig.load(build.artifact)
    ids, layers = list(range(5, 29)), [config.n_layers - 1, 0]
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((config.n_layers, config.d_model)).astype(np.float32)  # (L, d)
    inside = LookInside(("residual_norms",))
    model = attention_model(build, engine_adapters(build))
    assert model.steers and model.steers_under_adapters()
    maps, got = model.look(ids, KINDS, layers, "alpha", inside, steer=rows)
    _, unsteered = model.look(ids, KINDS, layers, "alpha", inside)
    x = np.asarray([ids], np.int64)
    names = [*(io.attention_output_name(i, k) for k in KINDS for i in layers),
             *inside.outputs(layers)]
    values = dict(zip(names, build.merged.run(names, {
        io.INPUT_IDS: x, io.ATTENTION_MASK: np.ones_like(x),
        io.POSITION_IDS: np.arange(len(ids))[None, :], io.STEER: rows}), strict=True))
    check(maps, {k: np.concatenate([values[io.attention_output_name(i, k)] for i in layers])
                 for k in KINDS}, "under a control vector")
    want = inside.collect(values, layers, config.n_layers, config.n_heads)
    np.testing.assert_allclose(got["residual_norms"], want["residual_norms"], rtol=1e-5)
    # the vector reached the stream (after block 1: the last layer's norms)
    assert np.abs(got["residual_norms"] - unsteered["residual_norms"]).max() > 1e-3
