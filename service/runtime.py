"""The serving runtime: everything the routes reach through ``app.state.runtime``.

Kept apart from app.py so routes and dependencies import it without importing the app
(no cycle: app → routes → deps → runtime).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from service.admission import AdmissionGate
from service.artifact import Artifact
from service.contract import io_spec as io
from service.engine.request import GenerationRequest, SamplingParams, StoppingCriteria
from service.engine.scheduler import Scheduler, SchedulerLimits
from service.engine.session import create_model, create_session
from service.engine.static_cache import PoolConfig
from service.metrics import Metrics
from service.offload import Offload, low_priority_threads
from service.settings import Settings
from service.validation import Validator
from service.viz.attention_model import AttentionModel

log = logging.getLogger("attnserve")


@dataclass
class Runtime:
    """Everything the routes reach through ``app.state.runtime``."""

    settings: Settings
    artifact: Artifact
    metrics: Metrics
    validator: Validator
    scheduler: Scheduler | None = None
    attention: AttentionModel | None = None
    provider: str | None = None
    decode_graph: str | None = None  # model.onnx, or engine.onnx with its in-place KV cache
    ready: bool = False
    draining: bool = False
    load_error: str | None = None
    started_at: float = field(default_factory=time.time)
    attention_gate: AdmissionGate = field(init=False)
    attention_encoder: Offload = field(init=False)
    attention_threads: ThreadPoolExecutor = field(init=False)

    def __post_init__(self) -> None:
        self.attention_gate = AdmissionGate(
            "/attention", self.settings.attention_max_concurrent,
            self.settings.attention_max_queued, "attention_busy",
            on_change=self.metrics.record_admission)
        # One encoding process per admitted request: the gate bounds how many are busy.
        self.attention_encoder = Offload(self.settings.attention_max_concurrent)
        # attention.onnx runs here, below the decode loop's priority (offload.py).
        self.attention_threads = low_priority_threads(self.settings.attention_max_concurrent,
                                                      "attnserve-attention")


def pool_config(settings: Settings, config: io.ArtifactConfig, slot_tokens: int) -> PoolConfig:
    """Slots and prefix-cache blocks for engine.onnx's KV pool, from the memory settings.

    A slot holds ``slot_tokens`` (max_total_tokens: vLLM's max_model_len), not the model's
    whole context, so a long-context model (SmolLM2 8k, Qwen2.5 32k) is served in the
    memory its requests can use.
    """
    token_bytes = 2 * config.n_layers * config.kv_heads * config.head_dim * 4  # float32 K and V
    slot_bytes = token_bytes * slot_tokens
    slots = settings.max_batch_size
    if settings.kv_cache_memory_mb is not None:
        fit = int(settings.kv_cache_memory_mb * 2**20 // slot_bytes)
        if fit < 1:
            raise ValueError(f"kv_cache_memory_mb {settings.kv_cache_memory_mb} holds no "
                             f"slot of max_total_tokens {slot_tokens} "
                             f"({slot_bytes / 2**20:.2f} MiB each)")
        slots = min(slots, fit)
    blocks = 0
    if settings.prefix_caching:
        block_bytes = token_bytes * settings.prefix_block_size
        blocks = max(1, int(settings.prefix_cache_memory_mb * 2**20 // block_bytes))
    return PoolConfig(slots=slots, prefix_block_size=settings.prefix_block_size,
                      prefix_cache_blocks=blocks, max_len=slot_tokens)


def load_engine(runtime: Runtime) -> None:
    """Create the sessions and warm them up (blocking; runs in a worker thread)."""
    settings, artifact = runtime.settings, runtime.artifact
    config = artifact.config
    model = create_model(artifact.path, config, settings.device, settings.intra_op_threads,
                         settings.engine_graph,
                         pool_config(settings, config, artifact.limits.max_total_tokens))
    # The attention dump runs rarely: its weights stay in the page cache mapped from
    # weights.bin (shared) rather than in a second packed copy beside the decoder's.
    attention = AttentionModel(create_session(artifact.path / io.ATTENTION_FILE, "cpu"
                                              if model.device == "cpu" else settings.device,
                                              settings.attention_threads, prepack=False),
                               config)
    limits = artifact.limits
    batch_size = limits.max_batch_size
    pool = getattr(model, "pool", None)
    if pool is not None and pool.slots < batch_size:
        log.warning("the KV pool budget holds %d slots: batches are capped at %d rows, not "
                    "max_batch_size %d", pool.slots, pool.slots, batch_size)
        batch_size = pool.slots
    scheduler = Scheduler(
        model, artifact.codec,
        SchedulerLimits(batch_size, limits.max_batch_tokens, limits.max_queued_requests,
                        settings.prefill_chunk_tokens, settings.adaptive_prefill_chunks),
        pad_token_id=config.fill_token_id, stats=runtime.metrics)
    started = time.perf_counter()
    if runtime.validator.grammars is not None:
        runtime.validator.grammars.tokenizer()  # structured output's table, off the event loop
    scheduler.warmup(GenerationRequest([config.start_token_id], SamplingParams(),
                                       StoppingCriteria(max_new_tokens=4)))
    attention.run([config.start_token_id], ["weights"])
    log.info("model %s on %s (%s), warmed up in %.0f ms", artifact.name, model.provider,
             model.graph_file, (time.perf_counter() - started) * 1000)
    runtime.metrics.set_model_info(artifact.name, model.provider, artifact.sha256)
    runtime.scheduler, runtime.attention, runtime.provider = scheduler, attention, model.provider
    runtime.decode_graph = model.graph_file


