"""The engine: one object that turns an artifact into a running decode loop.

What vLLM's LLMEngine is to its server: ``Engine.from_artifact(artifact, EngineConfig)``
picks the decoder graph, sizes its KV pool and prefix cache by the memory settings,
builds the scheduler and warms it up; the server, the benchmarks and the tests all build
it this way and then only ``start``, ``submit`` and ``stop`` it.

KV memory is a budget of tokens, not slots x context: ``kv_cache_memory_mb`` bounds the
tokens the pool may hold at once (``kv_bytes_per_token`` each), and admission counts each
request's reserved tokens (prompt + max_new_tokens) against it, so a pool of
``max_batch_size`` slots of ``max_total_tokens`` costs what its rows hold, not what they
could hold.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path

import numpy as np

from service import ops
from service.artifact.loader import Artifact
from service.contract import io_spec as io
from service.contract.graphs import GraphEntry, GraphTable
from service.contract.manifest import load_manifest, verify_manifest
from service.contract.pages import release_file_pages
from service.engine.adapters import AdapterLimits, AdapterSet, lora_entries
from service.engine.control_vectors import ControlVectors, control_entries
from service.engine.draft import DraftModel
from service.engine.engine_graph_runner import EngineGraphRunner
from service.engine.model_graph_runner import ModelGraphRunner
from service.engine.process_memory import collapse_to_huge_pages
from service.engine.request import GenerationRequest, SamplingParams, StoppingCriteria
from service.engine.runner import ModelRunner, PoolConfig
from service.engine.scheduler import RequestHandle, Scheduler, SchedulerLimits
from service.engine.speculative import SpeculativeConfig, Speculator
from service.engine.stats import KVStats, PrefixCacheStats, StatsSink
from service.providers import CUDA, create_session, select_providers
from service.settings import Device, Limits, ServeOptions, Settings, of_settings

log = logging.getLogger("attnserve.engine")


class EngineConfig(ServeOptions):
    """Everything that shapes the engine beyond the artifact (vLLM's EngineArgs): the
    serving options themselves, so an engine setting is its Settings field and nothing
    more. One default differs: an engine made directly (tests, benchmarks) runs on the
    CPU; served, ``--device auto`` picks."""

    device: Device = "cpu"

    @classmethod
    def from_settings(cls, settings: Settings, limits: Limits) -> EngineConfig:
        """Every setting, the limits as resolved for the artifact (``limits``)."""
        values = {name: getattr(settings, name) for name in ServeOptions.model_fields}
        return cls(**values | {f.name: getattr(limits, f.name) for f in fields(Limits)})

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """``--speculative-model ngram|DIR`` and its companions (None: one token per row
        per step)."""
        if self.speculative_model is None:
            return None
        return of_settings(SpeculativeConfig, self, method="ngram"
                           if self.speculative_model == "ngram" else "draft")


def create_speculator(artifact: Artifact, config: EngineConfig) -> Speculator | None:
    """The speculation policy, with the draft model's own runner and pool if it has one.

    A draft must share the target's tokenizer (the same tokenizer.json, by the manifests'
    hashes) and vocabulary size: it proposes ids, and verification compares distributions
    over the same ids.
    """
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        return Speculator(spec)
    path = Path(str(config.speculative_model))
    try:
        manifest = verify_manifest(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--speculative-model {path}: {exc}") from None
    draft_config = io.ArtifactConfig.load(path)
    tokenizer = manifest.files.get(io.TOKENIZER_FILE)
    if tokenizer is None or tokenizer.sha256 != artifact.files.get(io.TOKENIZER_FILE):
        raise ValueError(f"--speculative-model {path}: its tokenizer.json differs from the "
                         "served model's; a draft must use the same tokenizer")
    if draft_config.vocab_size != artifact.config.vocab_size:
        raise ValueError(f"--speculative-model {path}: vocabulary of "
                         f"{draft_config.vocab_size} ids, the served model has "
                         f"{artifact.config.vocab_size}")
    rows = spec.speculative_max_batch_rows
    max_len = min(config.max_total_tokens or artifact.config.max_seq_len,
                  draft_config.max_seq_len)
    # The draft takes turns with the target on the same cores: its workers must not spin
    # on after its steps, or the target's next pass runs at half speed.
    draft_runner = create_runner(path, draft_config, config.model_copy(update=dict(
        max_batch_size=rows, max_batch_tokens=rows * max_len, max_total_tokens=max_len,
        kv_cache_memory_mb=None, prefix_caching=False, speculative_model=None,
        lora_modules=(), runtime_lora=False)),  # drafts are proposals: the base's
        spin_wait=False)
    return Speculator(spec, DraftModel(draft_runner, spec.num_speculative_tokens, max_len))


def pool_config(engine: EngineConfig, model: io.ArtifactConfig, token_bytes: int) -> PoolConfig:
    """Slots, token budget and prefix-cache blocks of the KV pool, from the memory settings.

    A slot holds ``max_total_tokens`` (vLLM's max_model_len), not the model's whole
    context; the budget is what the pool may hold over all slots at once: the tokens
    ``kv_cache_memory_mb`` holds, and never more than ``max_batch_tokens``, which admission
    enforces anyway.
    """
    max_len = min(engine.max_total_tokens or model.max_seq_len, model.max_seq_len)
    budget = engine.max_batch_tokens  # admission never lets more tokens in
    if engine.kv_cache_memory_mb is not None:
        fit = int(engine.kv_cache_memory_mb * 2**20 // token_bytes)
        if fit < max_len:
            raise ValueError(f"kv_cache_memory_mb {engine.kv_cache_memory_mb} holds {fit} "
                             f"tokens of {token_bytes:,} bytes, fewer than max_total_tokens "
                             f"{max_len}: a long request could never run")
        budget = min(budget, fit)
    blocks = 0
    if engine.prefix_caching:
        block_bytes = token_bytes * engine.prefix_block_size
        blocks = max(1, int(engine.prefix_cache_memory_mb * 2**20 // block_bytes))
    return PoolConfig(slots=engine.max_batch_size, prefix_block_size=engine.prefix_block_size,
                      prefix_cache_blocks=blocks, max_len=max_len, budget_tokens=budget)


def create_runner(artifact_dir: Path, model: io.ArtifactConfig, engine: EngineConfig,
                  spin_wait: bool = True) -> ModelRunner:
    """The runner over the graphs the artifact's table (service/contract/graphs.py) serves
    with these settings: an engine graph over the KV pool (on CUDA, a float16 artifact's
    engine.onnx with the pool in device memory), with a quantised artifact's float32
    weights for long passes beside it; else model.onnx through the same pool. The steps
    graph is one session with packed weights (two would each keep a packed copy); the
    float32 one reads its weights where ONNX Runtime memory-mapped them (page cache shared
    with weights.bin, no packed copy)."""
    on_cuda = select_providers(engine.device)[0] == CUDA
    adapters = engine.serves_adapters
    served = GraphTable.of(load_manifest(artifact_dir)).served(
        engine_graph=engine.engine_graph, mixed_steps=engine.mixed_steps, on_cuda=on_cuda,
        float32_pass_tokens=engine.float32_pass_tokens, adapters=adapters)
    steps, *long = served
    pool = pool_config(engine, model, model.kv_bytes_per_token(np.dtype(steps.kv_dtype).itemsize))
    log.info("%s runs %s", artifact_dir.name, steps.describe())
    if ops.kernel_in_use(steps.kernel) == "ggml":
        log.info("GGUF blocks computed by ggml's CPU kernels inside ONNX Runtime: %s; "
                 "attention: %s", ops.library_path(),
                 ops.attention_in_use(artifact_dir / steps.file))
    if steps.runs == "fallback":
        return ModelGraphRunner(create_session(artifact_dir / steps.file, engine.device,
                                               engine.intra_op_threads, spin_wait=spin_wait),
                                model, pool, entry=steps)
    if on_cuda:  # the prefix store is host memory: none on the device (cuda.py)
        return EngineGraphRunner(
            create_session(artifact_dir / steps.file, "cuda", engine.intra_op_threads,
                           cuda_graphs=engine.cuda_graphs),
            model, replace(pool, prefix_cache_blocks=0), device="cuda",
            cuda_graphs=engine.cuda_graphs, steps=steps)
    session = create_session(artifact_dir / steps.file, "cpu", engine.intra_op_threads,
                             spin_wait=spin_wait)
    extra = {g: create_session(artifact_dir / g.file, "cpu", engine.intra_op_threads,
                               prepack=False, spin_wait=spin_wait) for g in long}
    runner = EngineGraphRunner(session, model, pool, long_passes=extra, steps=steps,
                               adapter_limits=of_settings(AdapterLimits, engine)
                               if adapters else None)
    for graph in runner.graphs[1:]:
        log.info("%s runs %s", artifact_dir.name, graph.describe())
    return runner


def add_startup_adapters(adapters: AdapterSet | None, config: EngineConfig) -> None:
    """Serve the adapters ``--lora-modules`` names (NAME=DIR each), every one read and
    checked now: one that does not fit the model stops the server with one line."""
    for name, directory in lora_entries(config.lora_modules):
        assert adapters is not None  # serves_adapters made the runner with them
        adapters.add(adapters.read(directory, name))
        log.info("serving LoRA adapter %s from %s", name, directory)


def add_startup_control_vectors(runner: ModelRunner, config: EngineConfig) -> None:
    """Serve the control vectors ``--control-vectors`` names (NAME=FILE each), every one read
    and checked against the model now: one that does not fit stops the server with one
    line, as does a graph that cannot steer (an export of before ``steer``, model.onnx,
    CUDA)."""
    entries = control_entries(config.control_vectors)
    if not entries:
        return
    vectors = runner.control_vectors
    if vectors is None:
        raise ValueError(f"{runner.graph_file} on {runner.device} applies no control vector "
                         "(the engine graph on the CPU does, exported since it takes steer)")
    for name, path in entries:
        vectors.add(name, vectors.read(path))
        log.info("serving control vector %s from %s", name, path)


class Engine:
    """A runner, its KV pool and prefix cache, and the scheduler loop over them."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler) -> None:
        self.runner = runner
        self.scheduler = scheduler

    @classmethod
    def from_artifact(cls, artifact: Artifact, config: EngineConfig,
                      stats: StatsSink | None = None, warmup: bool = True) -> Engine:
        """Build the runner and the scheduler (blocking: sessions load, the pool is sized)
        and run one short request through them, so the first real one pays no set-up."""
        model = artifact.config
        runner = create_runner(artifact.path, model, config)
        add_startup_adapters(runner.adapters, config)
        add_startup_control_vectors(runner, config)
        kv = runner.kv_stats()
        log.info("decoding with %s: KV pool of %d slots x up to %d tokens, budget %d tokens "
                 "(%.1f MiB)%s", runner.graph_file, kv.slots,
                 min(config.max_total_tokens or model.max_seq_len, model.max_seq_len),
                 kv.capacity_tokens,  # bytes a token: the pool's reserved bytes over its tokens
                 kv.capacity_tokens * kv.bytes_allocated / (kv.slots * runner.max_len) / 2**20,
                 f", prefix cache of {p.capacity_blocks} blocks x {p.block_size} tokens"
                 if (p := runner.prefix_stats()) else "")
        limits = of_settings(SchedulerLimits, config)
        speculator = create_speculator(artifact, config)
        engine = cls(runner, Scheduler(runner, artifact.codec, limits, stats, speculator))
        if warmup:
            started = time.perf_counter()
            engine.scheduler.warmup(GenerationRequest(
                [model.start_token_id], SamplingParams(), StoppingCriteria(max_new_tokens=4)))
            log.info("engine warmed up in %.0f ms", (time.perf_counter() - started) * 1000)
        released = release_file_pages(artifact.path)  # e.g. a tied embedding packed at load
        if released:
            log.info("%.0f MiB of weights read once at load dropped from memory "
                     "(faulted back in as read)", released / 2**20)
        if config.huge_pages:  # after the warm-up: its buffers are written by now
            started = time.perf_counter()
            moved = collapse_to_huge_pages()
            if moved:
                log.info("%.0f MiB of packed weights and buffers moved into 2 MiB pages in "
                         "%.0f ms", moved / 2**20, (time.perf_counter() - started) * 1000)
        return engine

    @property
    def provider(self) -> str:
        return self.runner.provider

    @property
    def graph_file(self) -> str:
        return self.runner.graph_file

    @property
    def float32_pass_tokens(self) -> int | None:
        """Passes of this many tokens or more run on float32 weights; None: never."""
        return self.runner.float32_pass_tokens

    @property
    def adapters(self) -> AdapterSet | None:
        """The LoRA adapters served (None: the engine applies none)."""
        return self.runner.adapters

    @property
    def control_vectors(self) -> ControlVectors | None:
        """The control vectors served (None: the graph applies none)."""
        return self.runner.control_vectors

    @property
    def graphs(self) -> tuple[GraphEntry, ...]:
        """The artifact's graphs the runner opened, the one for steps first."""
        return self.runner.graphs

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.scheduler.start(loop)

    def submit(self, requests: Sequence[GenerationRequest]) -> list[RequestHandle]:
        return self.scheduler.submit(requests)

    def stop(self, timeout: float | None = None) -> None:
        self.scheduler.stop(timeout)

    def kv_stats(self) -> KVStats:
        return self.runner.kv_stats()

    def prefix_stats(self) -> PrefixCacheStats | None:
        return self.runner.prefix_stats()
