"""The serving runtime: everything the routes reach through ``app.state.runtime``.

Kept apart from app.py so routes and dependencies import it without importing the app
(no cycle: app → routes → deps → runtime).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np

from service import ops
from service.artifact.loader import Artifact
from service.contract import io_spec as io
from service.engine.adapters import AdapterWeights
from service.engine.engine import Engine, EngineConfig
from service.http.admission import AdmissionGate
from service.http.metrics import Metrics
from service.http.validation import Validator
from service.low_priority import Offload, low_priority_threads
from service.providers import create_session
from service.settings import Settings
from service.viz.attention_model import AttentionModel
from service.viz.look_inside import LookInside

log = logging.getLogger("attnserve")


@dataclass
class Runtime:
    """Everything the routes reach through ``app.state.runtime``."""

    settings: Settings
    artifact: Artifact
    metrics: Metrics
    validator: Validator
    engine: Engine | None = None
    attention: AttentionModel | None = None
    ready: bool = False
    draining: bool = False
    load_error: str | None = None
    started_at: float = field(default_factory=time.time)
    attention_gate: AdmissionGate = field(init=False)
    attention_encoder: Offload = field(init=False)
    attention_threads: ThreadPoolExecutor = field(init=False)
    # LoRA adapters served, name → directory (/v1/models' root): --lora-modules', then
    # those loaded and unloaded at run time (routes/lora.py)
    adapter_roots: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.adapter_roots = configured_adapters(self.settings.lora_modules)
        for name in self.adapter_roots:
            self.metrics.allow_adapter(name, configured=True)
        self.attention_gate = AdmissionGate(
            "/attention", self.settings.attention_max_concurrent,
            self.settings.attention_max_queued, "attention_busy",
            on_change=self.metrics.record_admission)
        # One encoding process per admitted request: the gate bounds how many are busy.
        self.attention_encoder = Offload(self.settings.attention_max_concurrent)
        # attention.onnx runs here, below the decode loop's priority (low_priority.py).
        self.attention_threads = low_priority_threads(self.settings.attention_max_concurrent,
                                                      "attnserve-attention")

    @property
    def provider(self) -> str | None:
        return self.engine.provider if self.engine is not None else None

    @property
    def decode_graph(self) -> str | None:
        """model.onnx, or engine.onnx with its in-place KV cache."""
        return self.engine.graph_file if self.engine is not None else None

    @property
    def kernel(self) -> dict[str, str | None]:
        """Whose kernels compute the decode graph's weights: ONNX Runtime's own, ggml's over
        a GGUF file's blocks (the op library then named: service/ops), or ONNX Runtime's
        over those blocks dequantised where the library cannot load; and its attention
        (the library's CachedAttention or ONNX Runtime's GroupQueryAttention)."""
        if self.engine is None:
            return {"weights": None, "library": None, "attention": None}
        steps = self.engine.graphs[0]
        kernel = ops.kernel_in_use(steps.kernel)
        library = ops.library_path() if kernel == "ggml" else None
        return {"weights": kernel, "library": None if library is None else str(library),
                "attention": ops.attention_in_use(self.artifact.path / steps.file)}

    @property
    def graphs(self) -> list[dict[str, object]]:
        """The artifact's graphs the engine runs and when (service/contract/graphs.py)."""
        return [asdict(g) for g in self.engine.graphs] if self.engine is not None else []

    @property
    def batch_limits(self) -> tuple[int, int]:
        """max_batch_size and max_batch_tokens as the scheduler applies them: the settings,
        bounded by the KV pool's slots and token budget once the engine exists."""
        if self.engine is None:
            return self.settings.max_batch_size, self.settings.max_batch_tokens
        limits = self.engine.scheduler.limits
        return limits.max_batch_size, limits.max_batch_tokens

    @property
    def float32_pass_tokens(self) -> int | None:
        """From how many tokens a pass runs on float32 weights; None: never."""
        return self.engine.float32_pass_tokens if self.engine is not None else None


    def adapter_names(self) -> list[str]:
        """The adapters a request may name now: the engine's (loaded, not unloading); before
        it exists, the ones --lora-modules names."""
        if self.engine is None:
            return list(self.adapter_roots)
        adapters = self.engine.adapters
        return adapters.names() if adapters is not None else []

    def add_adapter(self, weights: AdapterWeights) -> None:
        """Serve ``weights`` by its name from now on (a run-time load: the route's, or Ray
        Serve's multiplexing); ValueError if the name is taken."""
        assert self.engine is not None and self.engine.adapters is not None
        self.engine.adapters.add(weights)
        self.adapter_roots[weights.name] = str(weights.path)
        self.metrics.allow_adapter(weights.name)

    def remove_adapter(self, name: str) -> bool:
        """Stop serving ``name``, waiting up to drain_timeout for its requests (False: they
        outlasted it; it leaves when they finish). UnknownAdapter if it is not served."""
        assert self.engine is not None and self.engine.adapters is not None
        self.metrics.adapter_counts.sync()  # its loads and evictions, before they go
        done = self.engine.adapters.remove(name, self.settings.drain_timeout)
        if done:
            self.adapter_roots.pop(name, None)
        return done

    @property
    def attention_takes_adapters(self) -> bool:
        """Whether the attention model computes under a LoRA adapter (the engine serves
        adapters and the artifact has attention_lora.onnx)."""
        return self.attention is not None and self.attention.applies_adapters

    def attend(self, ids: Sequence[int], kinds: Sequence[str], layers: Sequence[int],
               adapter: str | None = None, steer: np.ndarray | None = None
               ) -> dict[str, np.ndarray]:
        """The attention model over ``ids`` (blocking), under ``adapter`` when one is named
        (the route checked the name and ``attention_takes_adapters``), steered by ``steer``
        (n_layers, d) when given (the route checked that the graph takes it)."""
        assert self.attention is not None
        return self.attention.run(ids, kinds, layers, adapter=adapter, steer=steer)

    def look_inside(self, ids: Sequence[int], kinds: Sequence[str], layers: Sequence[int],
                    adapter: str | None, inside: LookInside, steer: np.ndarray | None = None
                    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """As :meth:`attend`, and what ``inside`` asks, in one pass (the route checked
        that the attention model ``looks_inside``)."""
        assert self.attention is not None
        return self.attention.look(ids, kinds, layers, adapter, inside, steer)


def configured_adapters(entries: Iterable[str]) -> dict[str, str]:
    """--lora-modules' NAME=DIR entries as name → directory (the engine checks them at
    start: a malformed one stops the server there)."""
    named = (e.partition("=") for e in entries)
    return {name: directory for name, sep, directory in named if sep and name and directory}


def load_engine(runtime: Runtime) -> None:
    """Build the engine and the attention session and warm them up (blocking; runs in a
    worker thread)."""
    settings, artifact = runtime.settings, runtime.artifact
    config = artifact.config
    started = time.perf_counter()
    if runtime.validator.grammars is not None:
        runtime.validator.grammars.tokenizer()  # structured output's table, off the event loop
    engine = Engine.from_artifact(artifact, EngineConfig.from_settings(settings, artifact.limits),
                                  stats=runtime.metrics)
    # The attention dump runs rarely: its weights stay in the page cache mapped from
    # weights.bin (shared) rather than in a second packed copy beside the decoder's.
    attention = AttentionModel(create_session(artifact.path / io.ATTENTION_FILE, "cpu"
                                              if engine.runner.device == "cpu"
                                              else settings.device,
                                              settings.attention_threads, prepack=False),
                               config, artifact.path / io.ATTENTION_FILE, engine.adapters)
    attention.run([config.start_token_id], ["weights"], [0])  # pages in layer 0 only
    log.info("model %s on %s (%s), loaded and warmed up in %.0f ms", artifact.name,
             engine.provider, engine.graph_file, (time.perf_counter() - started) * 1000)
    steps = engine.graphs[0]
    runtime.metrics.set_model_info(artifact.name, engine.provider, artifact.sha256,
                                   steps.file, ops.kernel_in_use(steps.kernel))
    runtime.metrics.watch_kv_resident(engine.runner.kv_resident_bytes)
    if engine.adapters is not None:
        runtime.metrics.watch_adapters(engine.adapters)
    if (prefix := engine.prefix_stats()) is not None:
        runtime.metrics.set_cache_config(prefix.block_size, prefix.capacity_blocks)
    runtime.engine, runtime.attention = engine, attention
