"""Rows of the continuous batch, each under its own control vector and scale (or none):
every request's greedy tokens equal those of the PyTorch model steered with its vector
alone (model/steering.py's ``steered``, llama.cpp's rule), whether it shares its passes
with rows under other vectors and scales, with plain rows, with a LoRA adapter's rows,
with a prompt prefilled in chunks beside decode rows, with drafted tokens verified
(prompt lookup); and the prefix cache reuses a prompt's keys and values only under the
same vector and scale.

The model is a random 4-layer Llama saved as a checkpoint here and exported with its
engine graphs; the vectors are written as llama.cpp control-vector files and read back by
the engine, as ``--control-vectors`` reads them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from model.checkpoint import CheckpointMeta, load_checkpoint, read_meta, save_checkpoint
from model.config import config_from_preset
from model.gpt import GPT
from model.steering import steered
from service.artifact.loader import open_artifact
from service.contract.control_vector import ControlVector, write_control_vector
from service.engine.control_vectors import UnknownControlVector
from service.engine.engine import Engine, EngineConfig
from service.engine.request import (
    ControlChoice,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
    TokenEvent,
)
from service.settings import Settings
from tests.conftest import torch_threads
from tests.service.lora_build import greedy_until_tie

N_LAYERS = 4


@dataclass
class SteerBuild:
    checkpoint: Path
    artifact: Path
    model: GPT
    vectors: dict[str, Path]  # name → control-vector file
    tables: dict[str, dict[int, np.ndarray]]  # name → its directions by layer


@pytest.fixture(scope="module")
def build(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> SteerBuild:
    """A random 4-layer Llama (the tiny checkpoint's tokenizer), its artifact with engine
    graphs, and two control vectors: one for every layer, one for layers 2 and 3."""
    from export.to_onnx import export_artifact

    root = tmp_path_factory.mktemp("steer")
    tokenizer = read_meta(tiny_checkpoint).tokenizer
    vocab = read_meta(tiny_checkpoint).model.vocab_size
    config = replace(config_from_preset("llama-tiny", vocab_size=vocab), n_layers=N_LAYERS)
    torch.manual_seed(0)
    gpt = GPT(config).eval()
    with torch.no_grad():
        for p in gpt.parameters():
            p.normal_(0, 0.3)
    text = (tiny_checkpoint / "tokenizer.json").read_text("utf-8")
    ckpt = save_checkpoint(root / "ckpt", gpt, CheckpointMeta(model=config, tokenizer=tokenizer,
                                                                training={}), text)
    with torch_threads(1):
        artifact = export_artifact(ckpt, root / "artifact", engine_graph=True, verify=False)
    rng = np.random.default_rng(0)
    d = config.d_model
    tables = {"calm": {k: rng.standard_normal(d).astype(np.float32) for k in (1, 2, 3)},
              "late": {k: rng.standard_normal(d).astype(np.float32) for k in (2, 3)}}
    vectors = {name: write_control_vector(ControlVector(table, "llama"), root / f"{name}.gguf")
               for name, table in tables.items()}
    return SteerBuild(ckpt, artifact, load_checkpoint(ckpt).model.eval(), vectors, tables)


def steered_greedy(build: SteerBuild, prompt: Sequence[int], new: int,
                   choice: ControlChoice | None) -> list[int]:
    """PyTorch's greedy tokens under ``choice`` alone (up to a near tie)."""
    model = build.model
    context: Any = nullcontext(model) if choice is None else steered(
        model, build.tables[choice.name], choice.scale, choice.layers)

    def last(seq: list[int]) -> np.ndarray:
        with torch.no_grad():
            return model(torch.tensor([seq])).logits[0, -1].numpy()  # (V,)

    with context:
        return greedy_until_tie(last, prompt, new)


def engine_of(build: SteerBuild, **options: Any) -> Engine:
    config = EngineConfig(intra_op_threads=1, max_batch_size=8, control_vectors=tuple(
        f"{name}={path}" for name, path in build.vectors.items()), **options)
    return Engine.from_artifact(open_artifact(Settings.model_validate(
        {"model": build.artifact})), config)


def generate(engine: Engine, batches: Sequence[Sequence[GenerationRequest]],
             between: Any = None) -> list[list[list[int]]]:
    """Every request's tokens, batch after batch: a batch's requests are submitted at once
    (they share the engine's passes), the next once they are done; ``between()`` runs
    before each batch. The engine is stopped at the end."""
    async def tokens(handle: Any) -> list[int]:
        out = []
        async for event in handle.events():
            assert isinstance(event, TokenEvent), event
            out.append(event.token.id)
        return out

    async def main() -> list[list[list[int]]]:
        engine.start(asyncio.get_running_loop())
        done = []
        for batch in batches:
            if between is not None:
                between()
            handles = engine.submit(list(batch))
            done.append(list(await asyncio.gather(*(tokens(h) for h in handles))))
        return done

    try:
        return asyncio.run(main())
    finally:
        engine.stop(5)


def greedy(prompt: list[int], n: int, choice: ControlChoice | None) -> GenerationRequest:
    return GenerationRequest(prompt, SamplingParams(), StoppingCriteria(n), control_vector=choice)


def prompts(vocab: int, lengths: Sequence[int], seed: int = 2) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, vocab, n)] for n in lengths]


def check(build: SteerBuild, requests: Sequence[GenerationRequest], got: list[list[int]]
          ) -> None:
    for request, tokens in zip(requests, got, strict=True):
        want = steered_greedy(build, request.prompt_ids, request.stopping.max_new_tokens,
                              request.control_vector)
        assert len(want) >= 4, f"the reference ties too early to judge: {request.control_vector}"
        assert tokens[:len(want)] == want, request.control_vector


CHOICES = [None, ControlChoice("calm", 1.0), ControlChoice("calm", -1.5),
           ControlChoice("late", 0.7), ControlChoice("calm", 2.0, (2, 3)), None]


def test_rows_under_different_vectors_scales_and_none_share_the_batch(build: SteerBuild
                                                                      ) -> None:
    """Six rows, one batch: the mixed graph's decode pass carries rows under two vectors,
    three scales, a layer range and none; a long prompt is prefilled in chunks of 8 tokens
    riding in those passes."""
    engine = engine_of(build, prefill_chunk_tokens=8, adaptive_prefill_chunks=False,
                       prefix_caching=False)
    assert engine.runner.mixes_chunks and engine.control_vectors is not None
    assert engine.control_vectors.names == ["calm", "late"]
    vocab = build.model.config.vocab_size
    requests = [greedy(p, 12, c) for p, c in zip(prompts(vocab, [5, 9, 3, 7, 6, 30]),
                                                 CHOICES, strict=True)]
    [got] = generate(engine, [requests])
    check(build, requests, got)
    plain = steered_greedy(build, requests[1].prompt_ids, 12, None)
    assert got[1][:len(plain)] != plain  # the vector changes what the row says


def test_the_prefix_cache_reuses_keys_only_under_the_same_vector_and_scale(
        build: SteerBuild) -> None:
    """One prompt, run again and again: under another vector or scale (or none) nothing is
    reused and each gives its own reference; under a scale seen before, its blocks are."""
    engine = engine_of(build, prefix_block_size=4)
    vocab = build.model.config.vocab_size
    prompt = prompts(vocab, [21], seed=2)[0]
    choices = [ControlChoice("calm", 1.0), ControlChoice("calm", 2.0), None,
               ControlChoice("late", 1.0), ControlChoice("calm", 2.0)]
    requests = [[greedy(prompt, 8, c)] for c in choices]
    hits: list[int] = []

    def count() -> None:
        stats = engine.prefix_stats()
        assert stats is not None
        hits.append(stats.hits)

    got = generate(engine, requests, between=count)
    count()
    for [request], [tokens] in zip(requests, got, strict=True):
        check(build, [request], [tokens])
    reused = np.diff(hits).tolist()  # prompt tokens reused by each request
    assert reused[:4] == [0, 0, 0, 0] and reused[4] > 0, reused


def test_an_unknown_vector_is_refused_at_submit(build: SteerBuild) -> None:
    engine = engine_of(build)
    with pytest.raises(UnknownControlVector):
        generate(engine, [[greedy([5, 6, 7], 4, ControlChoice("nope", 1.0))]])


def test_rows_with_adapters_and_rows_with_vectors_share_the_adapter_graph(
        lora_build: Any, llama_artifacts: Any, tmp_path: Path) -> None:
    """The tiny Llama's adapter graph: a row under LoRA adapter alpha, one under a vector,
    one under both and one under neither, in one batch: each gives its own model's greedy
    tokens (the base or alpha merged into it, steered or not)."""
    base = llama_artifacts("llama")
    models = {"": load_checkpoint(base.checkpoint).model.eval(),
              "alpha": load_checkpoint(lora_build.merged["alpha"].parent / "alpha-merged"
                                       ).model.eval()}
    width = models[""].config.d_model
    direction = {1: np.random.default_rng(3).standard_normal(width).astype(np.float32)}
    vector = write_control_vector(ControlVector(direction, "llama"), tmp_path / "v.gguf")
    config = EngineConfig(intra_op_threads=1, max_batch_size=8, max_loras=2, max_lora_rank=8,
                          lora_modules=tuple(f"{n}={d}" for n, d in lora_build.adapters.items()),
                          control_vectors=(f"v={vector}",))
    engine = Engine.from_artifact(open_artifact(Settings.model_validate(
        {"model": lora_build.artifact})), config)
    assert engine.adapters is not None and engine.control_vectors is not None
    vocab = models[""].config.vocab_size
    rows = [("", None), ("alpha", None), ("", ControlChoice("v", 1.5)),
            ("alpha", ControlChoice("v", 1.5))]
    requests = [GenerationRequest(p, SamplingParams(), StoppingCriteria(10),
                                  adapter_name=adapter or None, control_vector=choice)
                for p, (adapter, choice) in zip(prompts(vocab, [6, 4, 8, 5]), rows, strict=True)]
    [got] = generate(engine, [requests])
    for request, (adapter, choice), tokens in zip(requests, rows, got, strict=True):
        model = models[adapter]
        context: Any = nullcontext(model) if choice is None else steered(
            model, direction, choice.scale)

        def last(seq: list[int], model: GPT = model) -> np.ndarray:
            with torch.no_grad():
                return model(torch.tensor([seq])).logits[0, -1].numpy()  # (V,)

        with context:
            want = greedy_until_tie(last, request.prompt_ids, 10)
        assert len(want) >= 4 and tokens[:len(want)] == want, (adapter, choice)


def test_steered_rows_verify_drafts_under_their_own_vector(build: SteerBuild) -> None:
    """Prompt lookup proposes drafts from each row's repeating text; the verification pass
    of several tokens after the cache steers them as the row's decode steps do."""
    engine = engine_of(build, speculative_model="ngram", num_speculative_tokens=3,
                       speculative_adaptive=False, speculative_max_batch_rows=8,
                       prefix_caching=False)
    vocab = build.model.config.vocab_size
    loops = prompts(vocab, [4, 5, 3], seed=5)
    choices = [ControlChoice("calm", 1.0), ControlChoice("late", -0.7), None]
    requests = [greedy(loop * 4, 16, c) for loop, c in zip(loops, choices, strict=True)]
    [got] = generate(engine, [requests])
    check(build, requests, got)
    speculator = engine.scheduler.speculator
    assert speculator is not None and speculator.counters.drafts > 0
