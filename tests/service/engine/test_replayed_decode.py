"""Decode steps through the bucketed, in-place bindings that CUDA graphs replay
(service/engine/cuda.py), run on the CPU: the padding rows, the inputs written in place,
``total_sequence_length`` fed as the buffer's length and ``greedy_ids`` must change no
row's logits or tokens against the runner's plain passes and a plain loop by names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from export.to_onnx import export_artifact
from service.artifact.text import TextCodec
from service.contract import engine_spec as es
from service.contract import io_spec as io
from service.engine.cuda import CapturedDecode
from service.engine.engine_graph_runner import EngineGraphRunner
from service.engine.request import GenerationRequest, SamplingParams, StoppingCriteria
from service.engine.runner import PoolConfig
from service.providers import create_session
from tests.service.helpers import run_with_joins
from tests.service.runner_passes import decode, decode_ids, prefill

SLOTS, MAX_LEN = 8, 48


@pytest.fixture(scope="module")
def half_artifact(llama_artifacts: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    build = llama_artifacts("llama")
    return export_artifact(build.checkpoint, tmp_path_factory.mktemp("half") / "artifact",
                           dtype="float16", engine_graph=True, mixed_steps=False)


def runner_for(art: Path, replays: bool) -> EngineGraphRunner:
    config = io.ArtifactConfig.load(art)
    return EngineGraphRunner(create_session(art / es.ENGINE_FILE, "cpu", 1), config,
                             PoolConfig(slots=SLOTS, max_len=MAX_LEN), device="cpu",
                             cuda_graphs=replays)


def test_replayed_steps_equal_plain_passes(half_artifact: Path) -> None:
    rng = np.random.default_rng(0)
    config = io.ArtifactConfig.load(half_artifact)
    prompts = [rng.integers(0, config.vocab_size, n) for n in (5, 9, 3)]
    plain, replayed = runner_for(half_artifact, False), runner_for(half_artifact, True)
    rows = {}
    for r in (plain, replayed):
        slots = r.reserve(len(prompts))
        last = np.stack([x[-1] for x in prefill(r, slots, prompts)])  # (3, V)
        rows[id(r)] = (slots, last.argmax(-1))
    for step in range(6):
        (ps, pt), (rs, rt) = rows[id(plain)], rows[id(replayed)]
        assert (pt == rt).all()
        want = decode(plain, ps, pt)  # (3, V)
        if step % 2:  # token ids only: the graph's greedy_ids
            got_ids = decode_ids(replayed, rs, rt)
            assert (got_ids == want.argmax(-1)).all()
        else:
            got = decode(replayed, rs, rt)
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * np.abs(want).max())
            got_ids = got.argmax(-1)
        rows[id(plain)], rows[id(replayed)] = (ps, want.argmax(-1)), (rs, got_ids)
    assert replayed.graph_replays == 6 and plain.graph_replays == 0
    assert (plain.pool.lengths == replayed.pool.lengths).all()


def test_batches_joining_and_leaving_decode_the_plain_passes_tokens(half_artifact: Path
                                                                     ) -> None:
    """Greedy batches joining and leaving (rows moved by compaction, padding slots taken,
    steps that fit no bucket) decode, through token ids alone, what the runner's plain
    passes decode."""
    codec = TextCodec.from_file(half_artifact / io.TOKENIZER_FILE)
    config = io.ArtifactConfig.load(half_artifact)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (4, 7, 2, 6, 5, 3)]
    news = [9, 3, 12, 4, 6, 7]

    def waves() -> list[list[GenerationRequest]]:
        requests = [GenerationRequest(p, SamplingParams(), StoppingCriteria(n, (), None),
                                      token_logprobs=False)
                    for p, n in zip(prompts, news, strict=True)]
        return [requests[:3], requests[3:5], requests[5:]]

    replayed = runner_for(half_artifact, True)
    got = run_with_joins(replayed, codec, waves(), join_every=3)
    want = run_with_joins(runner_for(half_artifact, False), codec, waves(), join_every=3)
    assert sorted(got.values()) == sorted(want.values())
    assert [len(t) for t in got.values()] == news
    assert replayed.graph_replays > 0


def test_seeded_sampling_drawn_beside_the_logits_equals_the_hosts(half_artifact: Path
                                                                 ) -> None:
    """Seeded temperature/top-k/top-p requests (and a greedy one) through joins and leaves:
    the runner that draws on the logits' device (the sampler graph, run on the CPU here)
    gives the tokens the host sampler draws from the same replayed steps' logits (a batch
    of another size may round float16 logits apart, which a draw can notice)."""
    codec = TextCodec.from_file(half_artifact / io.TOKENIZER_FILE)
    config = io.ArtifactConfig.load(half_artifact)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (5, 3, 8, 4, 6)]
    params = [SamplingParams(do_sample=True, seed=11),
              SamplingParams(do_sample=True, temperature=0.6, top_k=20, seed=12),
              SamplingParams(),
              SamplingParams(do_sample=True, top_p=0.7, seed=13),
              SamplingParams(do_sample=True, temperature=1.4, top_k=50, top_p=0.95, seed=14)]

    def waves() -> list[list[GenerationRequest]]:
        requests = [GenerationRequest(p, s, StoppingCriteria(n, (), None), token_logprobs=False)
                    for p, s, n in zip(prompts, params, (10, 6, 12, 7, 9), strict=True)]
        return [requests[:3], requests[3:]]

    device = runner_for(half_artifact, True)
    assert device.samples_on_device
    got = run_with_joins(device, codec, waves(), join_every=3)
    host = runner_for(half_artifact, True)
    host.samples_on_device = False  # the same replays, their logits sampled on the host
    want = run_with_joins(host, codec, waves(), join_every=3)
    assert list(got.values()) == list(want.values())
    assert device.graph_replays > 0 and host.graph_replays > 0


def test_buckets_need_slot_zero_and_free_padding(half_artifact: Path) -> None:
    runner = runner_for(half_artifact, True)
    captured = runner._captured
    assert isinstance(captured, CapturedDecode)
    assert captured.buckets == (1, 2, 4, 8)
    slots = runner.reserve(3)  # slots 0, 1, 2
    assert captured.bucket_for(0, 3) == 4
    other = runner.reserve(1)  # slot 3: the 4-bucket's padding row is someone's
    assert other[0].index == 3 and captured.bucket_for(0, 3) is None
    assert captured.bucket_for(1, 2) is None  # a run that does not start at slot 0
    assert captured.bucket_for(0, 9) is None  # more rows than any bucket
    del slots


def test_on_cuda_the_device_pool_and_captured_graphs_decode_the_cpus_tokens(
        half_artifact: Path) -> None:
    """The GPU path proper (device pool, Identity copies, captured graphs): greedy batches
    through joins and leaves on CUDA decode what the same float16 graph decodes on the CPU.
    Only where onnxruntime has CUDA (CI has none; results/cuda/ holds the H100 runs)."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("needs onnxruntime-gpu and a CUDA GPU")
    from service.engine.cuda import DeviceKVPool

    config = io.ArtifactConfig.load(half_artifact)
    codec = TextCodec.from_file(half_artifact / io.TOKENIZER_FILE)
    cuda = EngineGraphRunner(create_session(half_artifact / es.ENGINE_FILE, "cuda", 1,
                                            cuda_graphs=True), config,
                             PoolConfig(slots=SLOTS, max_len=MAX_LEN), device="cuda",
                             cuda_graphs=True)
    assert isinstance(cuda.pool, DeviceKVPool)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (4, 7, 2, 6, 5)]

    def waves() -> list[list[GenerationRequest]]:
        requests = [GenerationRequest(p, SamplingParams(), StoppingCriteria(n, (), None),
                                      token_logprobs=False)
                    for p, n in zip(prompts, (9, 3, 12, 4, 6), strict=True)]
        return [requests[:3], requests[3:]]

    got = run_with_joins(cuda, codec, waves(), join_every=3)
    want = run_with_joins(runner_for(half_artifact, False), codec, waves(), join_every=3)
    assert sorted(got.values()) == sorted(want.values())
    assert cuda.graph_replays > 0 and cuda.pool.moves > 0
    # seeded sampling drawn on the GPU: the host sampler's draws from the same logits
    sampled = [GenerationRequest(p, SamplingParams(do_sample=True, top_k=30, top_p=0.9,
                                                   temperature=0.8, seed=40 + i),
                                 StoppingCriteria(8, (), None), token_logprobs=False)
               for i, p in enumerate(prompts[:3])]
    on_gpu = run_with_joins(cuda, codec, [sampled], join_every=1)
    cuda.samples_on_device = False
    again = [GenerationRequest(r.prompt_ids, r.sampling, r.stopping, token_logprobs=False)
             for r in sampled]
    on_host = run_with_joins(cuda, codec, [again], join_every=1)
    assert list(on_gpu.values()) == list(on_host.values())
