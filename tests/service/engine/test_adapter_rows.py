"""Rows of different LoRA adapters, and base rows, in the same passes of an adapter graph:
each row's logits equal what its merged model (`attnserve merge`, exported, run by the
plain model.onnx loop) gives that row's sequence alone.

The adapters are made by PEFT over transformers directly (random A and B, rank 8 on all
seven projections; rank 4 on q and v with rsLoRA), never by attnserve's trainer. The rows
join and leave, prefill together, ride in the decode pass of the mixed graph, feed a
chunk after their cache, and decode together; the prefix cache keys blocks by adapter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.contract import io_spec as io
from service.engine.adapters import UnknownAdapter
from service.engine.engine import EngineConfig, add_startup_adapters, create_runner
from service.engine.engine_graph_runner import EngineGraphRunner
from service.engine.request import BASE, ModelVariant
from service.engine.step_plan import RowWork, StepPlan
from tests.service.lora_build import TOL, LoraBuild, expected, greedy_until_tie, held, merged_greedy


def lora_runner(build: LoraBuild, **options: Any) -> EngineGraphRunner:
    config = EngineConfig(lora_modules=tuple(f"{n}={d}" for n, d in build.adapters.items()),
                          max_loras=2, max_lora_rank=8, max_batch_size=8, **options)
    runner = create_runner(build.artifact, io.ArtifactConfig.load(build.artifact), config)
    add_startup_adapters(runner.adapters, config)
    assert isinstance(runner, EngineGraphRunner) and runner.adapters is not None
    return runner


def run(runner: EngineGraphRunner, rows: list[RowWork]) -> list[np.ndarray]:
    return runner.run(StepPlan(tuple(rows))).outputs


def test_rows_of_two_adapters_and_the_base_share_every_kind_of_pass(lora_build: LoraBuild
                                                                     ) -> None:
    runner = lora_runner(lora_build, mixed_steps=True)
    assert runner.mixes_chunks
    adapters = runner.adapters
    assert adapters is not None
    refs = {"": None, "alpha": held(adapters, "alpha"), "beta": held(adapters, "beta")}
    rng = np.random.default_rng(0)
    vocab = runner.vocab_size
    names = ["", "alpha", "beta", "alpha"]
    seqs = [list(rng.integers(3, vocab, n)) for n in (5, 9, 3, 7)]
    variants = [ModelVariant(r.id) if (r := refs[n]) else BASE for n in names]  # each row's
    slots = runner.reserve(4)

    def row(i: int, tokens: list[int], first: bool = False) -> RowWork:
        return RowWork(slots[i], np.asarray(tokens), first=first, variant=variants[i])

    def check(outputs: list[np.ndarray], rows: list[int]) -> None:
        for out, i in zip(outputs, rows, strict=True):
            want = expected(lora_build, names[i], seqs[i])[-1]
            np.testing.assert_allclose(out[-1], want, rtol=0, atol=TOL,
                                       err_msg=f"row {i} under {names[i] or 'the base'}")

    # first prompts of three rows together (the fourth joins later)
    check(run(runner, [row(i, seqs[i], first=True) for i in range(3)]), [0, 1, 2])
    for _ in range(2):  # decode steps of rows under three different adapters
        for i in range(3):
            seqs[i].append(int(rng.integers(3, vocab)))
        check(run(runner, [row(i, seqs[i][-1:]) for i in range(3)]), [0, 1, 2])
    # the fourth row's prompt rides in the decode pass (the mixed graph's second group)
    for i in range(3):
        seqs[i].append(int(rng.integers(3, vocab)))
    rows = [row(i, seqs[i][-1:]) for i in range(3)]
    result = runner.run(StepPlan((*rows, row(3, seqs[3], first=True))))
    assert len(result.passes) == 1  # one pass carried all four rows
    check(result.outputs, [0, 1, 2, 3])
    # a chunk of several tokens after beta's cache rides beside the others' decode
    more = list(rng.integers(3, vocab, 4))
    seqs[2].extend(more)
    for i in (0, 1, 3):
        seqs[i].append(int(rng.integers(3, vocab)))
    rows = [row(i, seqs[i][-1:]) for i in (0, 1, 3)]
    result = runner.run(StepPlan((*rows, row(2, more))))
    check(result.outputs, [0, 1, 3, 2])
    # the alpha row leaves; the others go on, compacted
    kept = runner.leave(slots, [0, 2, 3], variants)
    for i in (0, 2, 3):
        seqs[i].append(int(rng.integers(3, vocab)))
    check(run(runner, [RowWork(s, np.asarray(seqs[i][-1:]), variant=variants[i])
                       for s, i in zip(kept, (0, 2, 3), strict=True)]), [0, 2, 3])


def test_every_position_and_a_lone_row_after_its_cache(lora_build: LoraBuild) -> None:
    """engine.onnx's adapter graph (one group): prompt logprobs (every position) and a row
    of several tokens after its cache, alone, under an adapter."""
    runner = lora_runner(lora_build, mixed_steps=False)
    assert not runner.mixes_chunks
    adapters = runner.adapters
    assert adapters is not None
    beta = held(adapters, "beta")
    rng = np.random.default_rng(1)
    seq = list(rng.integers(3, runner.vocab_size, 6))
    (slot,) = runner.reserve(1)
    under_beta = ModelVariant(beta.id)
    (every,) = run(runner, [RowWork(slot, np.asarray(seq), "every", first=True,
                                    variant=under_beta)])
    np.testing.assert_allclose(every, expected(lora_build, "beta", seq), rtol=0, atol=TOL)
    more = list(rng.integers(3, runner.vocab_size, 3))
    seq += more
    (after,) = run(runner, [RowWork(slot, np.asarray(more), "every", variant=under_beta)])
    np.testing.assert_allclose(after, expected(lora_build, "beta", seq)[-3:], rtol=0, atol=TOL)


def test_a_prefix_cached_under_one_adapter_is_reused_by_it_alone(lora_build: LoraBuild
                                                                  ) -> None:
    runner = lora_runner(lora_build, prefix_caching=True, prefix_block_size=4)
    adapters = runner.adapters
    assert adapters is not None
    alpha = held(adapters, "alpha")
    prompt = np.asarray(np.random.default_rng(2).integers(3, runner.vocab_size, 13))
    under_alpha = ModelVariant(alpha.id)
    (slot,) = runner.reserve(1, prompts=[prompt], variants=[under_alpha])
    assert runner.cached_length(slot) == 0
    run(runner, [RowWork(slot, prompt, first=True, variant=under_alpha)])
    runner.leave([slot], [], [under_alpha])  # its blocks go to the prefix cache, under alpha
    for name in ("", "beta", "alpha"):
        ref = held(adapters, name) if name else None
        variant = ModelVariant(ref.id) if ref else BASE
        (slot,) = runner.reserve(1, prompts=[prompt], variants=[variant])
        cached = runner.cached_length(slot)
        assert cached == (12 if name == "alpha" else 0), name
        (out,) = run(runner, [RowWork(slot, prompt[cached:], first=not cached,
                                      variant=variant)])
        np.testing.assert_allclose(out[-1], expected(lora_build, name, list(prompt))[-1],
                                   rtol=0, atol=TOL, err_msg=name or "the base")
        runner.leave([slot], [], [variant])


def test_resolving_named_adapters_is_all_or_none(lora_build: LoraBuild) -> None:
    """The runner resolves what requests name all or none: beside an unknown adapter, a
    known one is not left counted in flight (its unload does not wait), and a resolved
    request's count ends at release."""
    from service.engine.request import GenerationRequest, SamplingParams, StoppingCriteria

    runner = lora_runner(lora_build)
    assert runner.adapters is not None
    known = sorted(lora_build.adapters)

    def asking(name: str) -> GenerationRequest:
        return GenerationRequest([5, 6], SamplingParams(), StoppingCriteria(max_new_tokens=2),
                                 adapter_name=name)

    first, unknown = asking(known[0]), asking("gamma")
    with pytest.raises(UnknownAdapter):
        runner.resolve([first, unknown])
    assert first.adapter is None and first.variant == BASE
    assert runner.adapters.remove(known[0], timeout=0)  # nothing of it in flight: gone now
    assert known[0] not in runner.adapters.counts()
    second = asking(known[1])
    runner.resolve([second])
    assert second.adapter is not None and second.variant == ModelVariant(second.adapter.id)
    assert runner.adapters.activity() == ([], [known[1]])  # in flight, not admitted
    assert not runner.adapters.remove(known[1], timeout=0)  # in flight: the unload waits
    assert known[1] in runner.adapters.counts()
    runner.release(second)
    assert known[1] not in runner.adapters.counts()  # the unload went with the request


def test_an_engine_serves_requests_of_each_adapter_as_their_merged_models(
        lora_build: LoraBuild) -> None:
    """Greedy requests of the base and both adapters in one engine, submitted together
    (mixed batches, rows joining and leaving as they finish), each equal to its merged
    model's greedy decoding alone; an unknown adapter is refused at submit."""
    import asyncio

    from service.artifact.loader import open_artifact
    from service.engine.engine import Engine
    from service.engine.request import (
        GenerationRequest,
        SamplingParams,
        StoppingCriteria,
        TokenEvent,
    )
    from service.settings import Settings

    artifact = open_artifact(Settings.model_validate({"model": lora_build.artifact}))
    config = EngineConfig(lora_modules=tuple(f"{n}={d}" for n, d in lora_build.adapters.items()),
                          max_loras=2, max_lora_rank=8, max_batch_size=8)
    engine = Engine.from_artifact(artifact, config)
    rng = np.random.default_rng(3)
    vocab = artifact.config.vocab_size
    asks = [(name, list(map(int, rng.integers(3, vocab, n))), new)
            for name, n, new in (("alpha", 5, 6), ("", 7, 3), ("beta", 4, 8), ("alpha", 9, 2),
                                 ("beta", 6, 5), ("", 3, 7))]

    async def main() -> list[list[int]]:
        engine.start(asyncio.get_running_loop())
        try:
            with pytest.raises(UnknownAdapter):
                engine.submit([GenerationRequest([5, 6], SamplingParams(),
                                                 StoppingCriteria(max_new_tokens=2),
                                                 adapter_name="gamma")])
            handles = engine.submit([GenerationRequest(
                prompt, SamplingParams(), StoppingCriteria(max_new_tokens=new),
                adapter_name=name or None) for name, prompt, new in asks])
            events = await asyncio.gather(*(h.all_events() for h in handles))
        finally:
            await asyncio.to_thread(engine.stop)
        return [[e.token.id for e in evs if isinstance(e, TokenEvent)] for evs in events]

    tokens = asyncio.run(main())
    compared = 0
    for (name, prompt, new), got in zip(asks, tokens, strict=True):
        want = merged_greedy(lora_build, name, prompt, new)
        assert got[:len(want)] == want, name or "the base"
        compared += len(want)
    assert compared >= 20  # most tokens had a clear margin: the comparison decided


def peft_greedy(build: LoraBuild, hf_dir: Path, adapter: str, prompt: list[int], new: int
                ) -> list[int]:
    """PEFT's own model (the adapter over transformers' base, unmerged) decoding greedily,
    up to a near tie."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(hf_dir)),
                                      str(build.adapters[adapter])).eval()
    with torch.no_grad():
        return greedy_until_tie(
            lambda seq: model(torch.tensor([seq])).logits[0, -1].float().numpy(), prompt, new)


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_served_rows_decode_as_peft_does_with_and_without_speculation(
        lora_build: LoraBuild, llama_artifacts: Any, speculative: str | None) -> None:
    """Rows of both adapters and the base in one engine, verified drafts (n-gram prompt
    lookup, every step) or not: each row's greedy tokens equal PEFT's over transformers."""
    import asyncio

    from service.artifact.loader import open_artifact
    from service.engine.engine import Engine
    from service.engine.request import (
        GenerationRequest,
        SamplingParams,
        StoppingCriteria,
        TokenEvent,
    )
    from service.settings import Settings

    artifact = open_artifact(Settings.model_validate({"model": lora_build.artifact}))
    config = EngineConfig(lora_modules=tuple(f"{n}={d}" for n, d in lora_build.adapters.items()),
                          max_loras=2, max_lora_rank=8, max_batch_size=4,
                          speculative_model=speculative, speculative_max_batch_rows=4,
                          speculative_adaptive=False)
    engine = Engine.from_artifact(artifact, config)
    rng = np.random.default_rng(4)
    motif = list(map(int, rng.integers(3, artifact.config.vocab_size, 3)))
    asks = [(name, motif * 3 + [int(t) for t in rng.integers(3, 50, 2)])
            for name in ("alpha", "beta", "")]  # repeated n-grams: prompt lookup proposes

    async def main() -> list[list[int]]:
        engine.start(asyncio.get_running_loop())
        try:
            handles = engine.submit([GenerationRequest(
                prompt, SamplingParams(), StoppingCriteria(max_new_tokens=8),
                adapter_name=name or None) for name, prompt in asks])
            events = await asyncio.gather(*(h.all_events() for h in handles))
        finally:
            await asyncio.to_thread(engine.stop)
        return [[e.token.id for e in evs if isinstance(e, TokenEvent)] for evs in events]

    tokens = asyncio.run(main())
    speculator = engine.scheduler.speculator
    if speculative:  # drafts were verified, rows of adapters among them
        assert speculator is not None and speculator.counters.drafts > 0
    hf_dir = llama_artifacts("llama").hf_dir
    compared = 0
    for (name, prompt), got in zip(asks, tokens, strict=True):
        want = (peft_greedy(lora_build, hf_dir, name, prompt, 8) if name
                else merged_greedy(lora_build, "", prompt, 8))
        assert got[:len(want)] == want, name or "the base"
        compared += len(want)
    assert compared >= 12
