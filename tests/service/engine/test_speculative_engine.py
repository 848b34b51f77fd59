"""Speculative decoding inside the engine: greedy text identical to the plain ORT greedy loop
over model.onnx (an independent reference) with prompt lookup and with a draft model, on
engine.onnx and on model.onnx through the pool; rows keep their KV cache consistent after
rejected drafts are rolled back; the draft's tokenizer is checked."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from service.artifact.text import TextCodec
from service.contract import io_spec as io
from service.contract.engine_spec import ENGINE_FILE
from service.engine.batch import Batch
from service.engine.draft import DraftModel
from service.engine.engine import EngineConfig, create_runner
from service.engine.request import GenerationRequest, SamplingParams, StoppingCriteria
from service.engine.runner import ModelRunner
from service.engine.scheduler import Scheduler, SchedulerLimits
from service.engine.speculative import SpeculativeConfig, Speculator
from service.engine.step import step_alone
from tests.service.helpers import record_graphs

# Code repeats itself: prompt lookup finds what comes next in the prompt.
REPETITIVE = ("def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\n"
              "def add(a, b):\n    return")
FREE = "The meaning of"


@pytest.fixture(scope="module")
def codec(artifact: Path) -> TextCodec:
    return TextCodec.from_file(artifact / io.TOKENIZER_FILE)


def runner_for(artifact: Path, engine_graph: bool, rows: int = 2) -> ModelRunner:
    return create_runner(artifact, io.ArtifactConfig.load(artifact), EngineConfig(
        intra_op_threads=1, max_batch_size=rows, engine_graph=engine_graph,
        prefix_caching=False))


def decode_alone(runner: ModelRunner, codec: TextCodec, prompt: list[int], max_new: int,
                 speculator: Speculator, sampling: SamplingParams | None = None
                 ) -> list[int]:
    """One request, prefilled then decoded with speculation until it finishes."""
    request = GenerationRequest(prompt, sampling or SamplingParams(),
                                StoppingCriteria(max_new, eos_token_id=None))
    batch = Batch.from_requests([request], codec, runner.vocab_size)
    out = [step_alone(runner, batch)[0][0].token.id]
    try:
        while batch.sequences[0].finish is None:
            out += [e.token.id for e in step_alone(runner, batch, speculator)[0]]
            slot = batch.slots[0]
            cached = int(runner.pool.lengths[slot.index])
            # The cache holds the prompt and every token but the newest (not fed yet).
            expected = [*prompt, *out[:-1]]
            assert cached == len(expected)
            assert runner.pool.tokens[slot.index, :cached].tolist() == expected
    finally:
        batch.release(runner)
        speculator.release(request.id)
    return out


@pytest.mark.parametrize("engine_graph", [True, False], ids=["engine.onnx", "model.onnx"])
def test_prompt_lookup_keeps_greedy_text_identical(
        engine_artifact: Path, codec: TextCodec, encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]], engine_graph: bool) -> None:
    runner = runner_for(engine_artifact, engine_graph)
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4,
                                              speculative_adaptive=False))
    for text in (REPETITIVE, FREE):
        prompt = encode(text)
        got = decode_alone(runner, codec, prompt, 40, speculator)
        assert got == reference_greedy(prompt, 40)[:40], text
    counters = speculator.counters
    assert counters.draft_tokens > 0, "prompt lookup never proposed on repetitive code"
    assert counters.accepted_tokens > 0
    assert runner.pool.used == 0


@pytest.fixture(scope="module")
def draft_artifact(engine_artifact: Path, tiny_checkpoint: Path,
                   tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A different model with the same tokenizer: the tiny model with noise in its weights."""
    import torch

    from export.onnx.engine_graph import export_engine
    from export.to_onnx import export_artifact
    from model.checkpoint import load_checkpoint, save_checkpoint

    loaded = load_checkpoint(tiny_checkpoint)
    model = loaded.model.eval()
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * p.std() * torch.randn(p.shape, generator=generator))
    root = tmp_path_factory.mktemp("draft")
    ckpt = save_checkpoint(root / "ckpt", model, loaded.meta,
                           (tiny_checkpoint / io.TOKENIZER_FILE).read_text())
    out = root / "artifact"
    export_artifact(ckpt, out)
    export_engine(model, out / ENGINE_FILE)
    return record_graphs(out)


@pytest.mark.parametrize("same_model", [True, False], ids=["itself", "perturbed"])
def test_draft_model_keeps_greedy_text_identical(
        engine_artifact: Path, draft_artifact: Path, codec: TextCodec,
        encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]], same_model: bool) -> None:
    runner = runner_for(engine_artifact, True)
    draft_dir = engine_artifact if same_model else draft_artifact
    draft_runner = runner_for(draft_dir, True, rows=1)
    config = SpeculativeConfig(method="draft", num_speculative_tokens=3,
                               speculative_adaptive=False)
    speculator = Speculator(config, DraftModel(draft_runner, 3, draft_runner.pool.shape.max_len))
    for text in (REPETITIVE, FREE):
        prompt = encode(text)
        assert decode_alone(runner, codec, prompt, 30, speculator) == \
            reference_greedy(prompt, 30)[:30]
        speculator.release(0)
    counters = speculator.counters
    assert counters.draft_tokens > 0
    if same_model:  # a model agrees with itself: every draft is kept
        assert counters.accepted_tokens == counters.draft_tokens
    else:
        assert 0 < counters.accepted_tokens < counters.draft_tokens


def test_sampled_rows_speculate_and_stay_in_the_vocabulary(
        engine_artifact: Path, codec: TextCodec, encode: Callable[[str], list[int]]) -> None:
    """Sampling with speculation produces valid tokens, is reproducible for a seed and keeps
    the cache consistent (decode_alone checks it every step); the distribution itself is
    tested on the rule (test_speculative.py)."""
    runner = runner_for(engine_artifact, True)
    params = SamplingParams(do_sample=True, temperature=0.7, top_p=0.95, seed=11)
    runs = []
    for _ in range(2):
        # One-token matches: a sampled continuation of this tiny model need not repeat a
        # 2-gram of the prompt (how often it does depends on the CPU that trained it),
        # while some of its 30 tokens always occur in the prompt, so drafts are made.
        speculator = Speculator(SpeculativeConfig(speculative_adaptive=False,
                                                  prompt_lookup_min=1))
        runs.append(decode_alone(runner, codec, encode(REPETITIVE), 30, speculator, params))
        assert speculator.counters.draft_tokens > 0
    assert runs[0] == runs[1]
    assert all(0 <= t < runner.vocab_size for t in runs[0])


def test_the_scheduler_speculates_only_at_small_batches(
        engine_artifact: Path, codec: TextCodec, encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    """Two requests at once: batched decoding while both run, speculation once one is left;
    both answers equal the reference and the step stats count the extra tokens."""
    runner = runner_for(engine_artifact, True, rows=4)
    speculator = Speculator(SpeculativeConfig(speculative_max_batch_rows=1,
                                              speculative_adaptive=False))
    scheduler = Scheduler(runner, codec, SchedulerLimits(
        max_batch_size=4, max_batch_tokens=4096, max_queued_requests=8,
        prefill_chunk_tokens=0, adaptive_prefill_chunks=False),
                          speculator=speculator)
    prompts = [encode(REPETITIVE), encode(FREE)]
    lengths = [40, 6]

    async def main() -> list[list[int]]:
        scheduler.start(asyncio.get_running_loop())
        handles = scheduler.submit([
            GenerationRequest(p, SamplingParams(), StoppingCriteria(n, eos_token_id=None))
            for p, n in zip(prompts, lengths, strict=True)])
        results = []
        for handle in handles:
            results.append([e.token.id for e in await handle.all_events()])  # type: ignore[union-attr]
        return results

    try:
        results = asyncio.run(main())
    finally:
        scheduler.stop(5)
    for prompt, n, got in zip(prompts, lengths, results, strict=True):
        assert got == reference_greedy(prompt, n)[:n]
    assert speculator.counters.accepted_tokens > 0
    assert runner.pool.used == 0


def test_a_draft_with_another_tokenizer_is_refused(engine_artifact: Path,
                                                   tmp_path: Path) -> None:
    from service.artifact.loader import open_artifact
    from service.contract.manifest import describe_files, load_manifest
    from service.engine.engine import create_speculator
    from service.settings import Settings

    other = tmp_path / "other"
    shutil.copytree(engine_artifact, other)
    tokenizer = other / io.TOKENIZER_FILE
    text = tokenizer.read_text()
    assert '"Ġre","turn"' in text
    tokenizer.write_text(text.replace('"Ġre","turn"', '"Ġr","eturn"'))  # another merge
    manifest = load_manifest(other)  # a consistent artifact whose tokenizer differs
    manifest.files.update(describe_files(other, [io.TOKENIZER_FILE]))
    manifest.write(other)

    artifact = open_artifact(Settings(model=engine_artifact))
    config = EngineConfig(speculative_model=str(other))
    with pytest.raises(ValueError, match="tokenizer"):
        create_speculator(artifact, config)


def test_the_draft_session_does_not_spin_after_its_steps(engine_artifact: Path) -> None:
    """The draft and the target take turns on the same cores: the draft's ONNX Runtime
    workers must sleep after each of its steps (spinning ones halved the target's speed),
    while the target keeps ONNX Runtime's default spin."""
    from service.artifact.loader import open_artifact
    from service.engine.engine import Engine
    from service.settings import Settings

    artifact = open_artifact(Settings(model=engine_artifact))
    engine = Engine.from_artifact(artifact, EngineConfig(
        intra_op_threads=1, max_batch_size=2, prefix_caching=False,
        speculative_model=str(engine_artifact)),
        warmup=False)
    speculator = engine.scheduler.speculator
    assert speculator is not None and isinstance(speculator.draft, DraftModel)
    key = "session.intra_op.allow_spinning"
    draft_options = speculator.draft.runner.session.get_session_options()  # type: ignore[attr-defined]
    target_options = engine.runner.session.get_session_options()  # type: ignore[attr-defined]
    assert draft_options.get_session_config_entry(key) == "0"
    with pytest.raises(Exception, match="allow_spinning"):  # unset: ONNX Runtime's default
        target_options.get_session_config_entry(key)
