"""The serving runtime: everything the routes reach through ``app.state.runtime``.

Kept apart from app.py so routes and dependencies import it without importing the app
(no cycle: app → routes → deps → runtime).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from service.artifact import Artifact
from service.contract import io_spec as io
from service.engine.request import GenerationRequest, SamplingParams, StoppingCriteria
from service.engine.scheduler import Scheduler, SchedulerLimits
from service.engine.session import AttentionModel, create_model, create_session
from service.metrics import Metrics
from service.settings import Settings
from service.validation import Validator

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


def load_engine(runtime: Runtime) -> None:
    """Create the sessions and warm them up (blocking; runs in a worker thread)."""
    settings, artifact = runtime.settings, runtime.artifact
    config = artifact.config
    model = create_model(artifact.path, config, settings.device, settings.intra_op_threads,
                         settings.engine_graph)
    attention = AttentionModel(create_session(artifact.path / io.ATTENTION_FILE, "cpu"
                                              if model.device == "cpu" else settings.device,
                                              settings.intra_op_threads), config)
    limits = artifact.limits
    scheduler = Scheduler(
        model, artifact.codec,
        SchedulerLimits(limits.max_batch_size, limits.max_batch_tokens,
                        limits.max_queued_requests),
        pad_token_id=config.fill_token_id, stats=runtime.metrics)
    started = time.perf_counter()
    scheduler.warmup(GenerationRequest([config.start_token_id], SamplingParams(),
                                       StoppingCriteria(max_new_tokens=4)))
    attention.run([config.start_token_id], ["weights"])
    log.info("model %s on %s (%s), warmed up in %.0f ms", artifact.name, model.provider,
             model.graph_file, (time.perf_counter() - started) * 1000)
    runtime.metrics.set_model_info(artifact.name, model.provider, artifact.sha256)
    runtime.scheduler, runtime.attention, runtime.provider = scheduler, attention, model.provider
    runtime.decode_graph = model.graph_file


