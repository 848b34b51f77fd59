"""Prometheus metrics: the only module that touches prometheus-client.

The engine emits StepStats, LoadStats and RequestStats (service/engine/stats.py); the HTTP
middleware reports each request's route, status and latency. Names carry the
``attnserve_`` prefix, labels stay low-cardinality (route templates, status codes,
rejection reasons), and latency buckets span 1 ms to 30 s. Each app has its own
registry, so several apps in one process (tests) never collide.

What an inference gateway's endpoint picker scrapes (Kubernetes Gateway API Inference
Extension's model-server protocol; vLLM's names with our prefix, its flags take any):
``attnserve_num_requests_waiting`` / ``_running``, ``attnserve_kv_cache_usage_perc`` (a
fraction, 0..1), ``attnserve_lora_requests_info`` (one series a scrape: ``max_lora`` and the
comma-separated ``running_lora_adapters`` / ``waiting_lora_adapters``, its value the time it
was read, by which the picker takes the latest) and ``attnserve_cache_config_info``
(``block_size``, ``num_gpu_blocks``: the prefix cache's blocks, for prefix-aware scoring).

LoRA adapters are a label (``adapter``) only on the ``attnserve_lora_*`` series, and only
names the server serves: every --lora-modules name, and the first
``MAX_RUNTIME_ADAPTER_LABELS`` distinct names loaded at run time; later ones are counted
under ``other``, so a client loading and unloading names cannot grow the exposition
without bound. Base-model requests are not counted there (they are every request
``attnserve_requests_total`` counts that no adapter label does).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, ClassVar

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from service.engine.stats import (
    STEP_FAILURES,
    LoadStats,
    RequestStats,
    StepFailure,
    StepStats,
)
from service.http.admission import AdmissionStats

if TYPE_CHECKING:
    from service.engine.adapters import AdapterSet

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
                   0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)
REJECTION_REASONS = ("queue_full", "attention_busy", "validation", "too_large", "unauthorized")
MAX_VECTOR_LABELS = 64  # distinct control-vector names given their own label
MAX_RUNTIME_ADAPTER_LABELS = 64  # distinct run-time adapter names given their own label
OTHER_ADAPTERS = "other"  # the label of the run-time names beyond those


class AdapterLabels:
    """The ``adapter`` label values: the names the server serves, bounded (module doc)."""

    def __init__(self, runtime_bound: int = MAX_RUNTIME_ADAPTER_LABELS) -> None:
        self._lock = threading.Lock()
        self._configured: set[str] = set()
        self._runtime: set[str] = set()
        self.runtime_bound = runtime_bound

    def allow(self, name: str, configured: bool) -> None:
        with self._lock:
            if configured:
                self._configured.add(name)
            elif name not in self._configured and len(self._runtime) < self.runtime_bound:
                self._runtime.add(name)

    def of(self, name: str) -> str:
        with self._lock:
            known = name in self._configured or name in self._runtime
        return name if known else OTHER_ADAPTERS


class AdapterCounts:
    """``attnserve_lora_loads_total`` and ``attnserve_lora_evictions_total{adapter}``, read
    from ``AdapterSet.counts()`` at scrape (and before an unload, which drops an adapter's
    counts): per name, what grew since the last read, added to its label's total."""

    KINDS: ClassVar[dict[str, str]] = {
        "loads": "Times a LoRA adapter was placed in a slot of the adapter graph.",
        "evictions": "Times a LoRA adapter left its slot for another (least recently used, "
                     "no running row on it)."}

    def __init__(self, labels: AdapterLabels) -> None:
        self.labels = labels
        self.source: Callable[[], dict[str, dict[str, int]]] | None = None
        self._lock = threading.Lock()
        self._seen: dict[str, dict[str, int]] = {}
        self._totals: dict[str, defaultdict[str, float]] = {
            kind: defaultdict(float) for kind in self.KINDS}

    def sync(self) -> None:
        if self.source is None:
            return
        counts = self.source()
        with self._lock:
            for name, now in counts.items():
                before = self._seen.get(name, {})
                for kind in self.KINDS:
                    value, last = now.get(kind, 0), before.get(kind, 0)
                    # fewer than last time: unloaded and loaded again under the name
                    grown = value - last if value >= last else value
                    if grown:
                        self._totals[kind][self.labels.of(name)] += grown
            self._seen = counts

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily(f"attnserve_lora_{k}", h, labels=["adapter"])
                for k, h in self.KINDS.items()]

    def collect(self) -> Iterator[Metric]:
        self.sync()
        with self._lock:
            for kind, help_text in self.KINDS.items():
                family = CounterMetricFamily(f"attnserve_lora_{kind}", help_text,
                                             labels=["adapter"])
                for label, value in sorted(self._totals[kind].items()):
                    family.add_metric([label], value)
                yield family


class LoraRequestsInfo:
    """``attnserve_lora_requests_info``, vLLM's ``vllm:lora_requests_info`` (module doc):
    exactly one series, read from the adapters at scrape; none where the server serves no
    adapters (as vLLM without LoRA)."""

    NAME = "attnserve_lora_requests_info"
    LABELS = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")
    HELP = ("LoRA adapters of the requests running and waiting (comma-separated), and the "
            "adapters a batch can hold; the value is the time it was read (Unix seconds).")

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.adapters: AdapterSet | None = None
        self.clock = clock

    def describe(self) -> list[Metric]:
        return [GaugeMetricFamily(self.NAME, self.HELP, labels=self.LABELS)]

    def collect(self) -> Iterator[Metric]:
        if self.adapters is None:
            return
        running, waiting = self.adapters.activity()
        family = GaugeMetricFamily(self.NAME, self.HELP, labels=self.LABELS)
        family.add_metric([str(self.adapters.slots.limits.max_loras), ",".join(running),
                           ",".join(waiting)], self.clock())
        yield family


class Metrics:
    def __init__(self) -> None:
        disable_created_metrics()  # no *_created series: they only add noise to dashboards
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        ProcessCollector(registry=r)
        self.requests = Counter("attnserve_requests", "HTTP requests by route and status.",
                                ["route", "status"], registry=r)
        self.e2e = Histogram("attnserve_e2e_request_latency_seconds",
                             "Time from request arrival to the last byte of the response.",
                             ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("attnserve_request_queue_time_seconds",
                                    "Time a request waited before its prefill started.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("attnserve_time_to_first_token_seconds",
                              "Time from arrival to the first generated token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("attnserve_inter_token_latency_seconds",
                             "Time between consecutive generated tokens of one request.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram("attnserve_prefill_duration_seconds",
                                 "Duration of one prefill forward pass (all joining requests).",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.decode = Histogram("attnserve_decode_step_duration_seconds",
                                "Duration of one decode step of the running batch.",
                                buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("attnserve_batch_size",
                                    "Sequences in each decode step.",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.prompt_tokens = Counter("attnserve_prompt_tokens",
                                     "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter("attnserve_generation_tokens",
                                         "Tokens generated.", registry=r)
        self.running = Gauge("attnserve_num_requests_running",
                             "Requests in the running batch.", registry=r)
        self.waiting = Gauge("attnserve_num_requests_waiting",
                             "Requests queued to join the batch.", registry=r)
        self.kv_tokens = Gauge("attnserve_kv_cache_tokens",
                               "Tokens whose keys and values the KV cache holds now.",
                               registry=r)
        self.kv_usage = Gauge(
            "attnserve_kv_cache_usage_perc",
            "Cached tokens as a fraction (0..1) of the KV pool's capacity in tokens.",
            registry=r)
        self.kv_slots = Gauge("attnserve_kv_cache_slots", "Rows the KV pool holds.",
                              registry=r)
        self.kv_slots_used = Gauge("attnserve_kv_cache_slots_used",
                                   "KV pool slots taken by requests.", registry=r)
        self.kv_capacity = Gauge("attnserve_kv_cache_capacity_tokens",
                                 "Tokens the KV pool can hold (0 without a pool).", registry=r)
        self.kv_bytes = Gauge("attnserve_kv_cache_bytes",
                              "Bytes reserved for the KV pool (address space, not memory).",
                              registry=r)
        self.kv_resident = Gauge("attnserve_kv_cache_resident_bytes",
                                 "Bytes of the KV pool in RAM now (its pages follow the tokens "
                                 "held); read at scrape time.", registry=r)
        self.kv_moves = Gauge("attnserve_kv_cache_rows_moved",
                              "Rows copied inside the KV pool to close holes, since start.",
                              registry=r)
        self.prefilling = Gauge("attnserve_num_requests_prefilling",
                                "Requests part-way through a chunked prefill.", registry=r)
        self.prefix_queries = Counter("attnserve_prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.", registry=r)
        self.prefix_hits = Counter("attnserve_prefix_cache_hits",
                                   "Prompt tokens whose keys/values came from the prefix cache.",
                                   registry=r)
        self.prefix_hit_rate = Gauge("attnserve_prefix_cache_hit_rate",
                                     "Prefix cache hits / queries (tokens) since start.",
                                     registry=r)
        self._prefix_seen = (0, 0, 0)  # queries, hits, evictions already counted
        # Speculative decoding, by vLLM's names (vllm:spec_decode_num_*).
        self.spec_drafts = Counter("attnserve_spec_decode_num_drafts",
                                   "Verification passes that carried drafted tokens.",
                                   registry=self.registry)
        self.spec_draft_tokens = Counter("attnserve_spec_decode_num_draft_tokens",
                                         "Tokens drafted (prompt lookup or draft model).",
                                         registry=self.registry)
        self.spec_accepted = Counter("attnserve_spec_decode_num_accepted_tokens",
                                     "Drafted tokens the target model accepted.",
                                     registry=self.registry)
        self.spec_accepted_per_pos = Counter(
            "attnserve_spec_decode_num_accepted_tokens_per_pos",
            "Drafted tokens accepted, by their position in the draft.", ["position"],
            registry=self.registry)
        self.spec_paused_steps = Counter(
            "attnserve_spec_decode_num_paused_steps",
            "Row steps decoded without drafts because speculation did not pay there.",
            registry=self.registry)
        self._spec_seen: tuple[int, int, int, tuple[int, ...], int] = (0, 0, 0, (), 0)
        self.prefix_blocks = Gauge("attnserve_prefix_cache_blocks",
                                   "Blocks held by the prefix cache.", registry=r)
        self.prefix_capacity = Gauge("attnserve_prefix_cache_capacity_blocks",
                                     "Blocks the prefix cache can hold.", registry=r)
        self.prefix_bytes = Gauge("attnserve_prefix_cache_bytes",
                                  "Bytes allocated for the prefix cache's block store.",
                                  registry=r)
        self.prefix_evictions = Counter("attnserve_prefix_cache_evictions",
                                        "Blocks evicted (least recently used).", registry=r)
        self.step_failures = Counter(
            "attnserve_step_failures", "Engine steps that raised, by what the scheduler did: "
            "retried (newcomers prefilled again one by one), failed (the step's requests got "
            "an error), loop (outside a forward pass: every request in flight failed).",
            ["kind"], registry=r)
        for kind in STEP_FAILURES:
            self.step_failures.labels(kind=kind)  # exported at 0 from the start
        self.rejected = Counter("attnserve_rejected_requests",
                                "Requests refused before reaching the engine, by reason.",
                                ["reason"], registry=r)
        for reason in REJECTION_REASONS:
            self.rejected.labels(reason=reason)  # exported at 0 from the start
        self.admitted = Gauge("attnserve_admission_requests",
                              "Requests inside a bounded side route (/attention), by state.",
                              ["route", "state"], registry=r)
        self.adapter_labels = AdapterLabels()
        self.lora_requests = Counter(
            "attnserve_lora_requests", "Requests that ran under each LoRA adapter (finished, "
            "cancelled or failed); base-model requests are not counted.", ["adapter"],
            registry=r)
        self.lora_tokens = Counter("attnserve_lora_generated_tokens",
                                   "Tokens generated under each LoRA adapter.", ["adapter"],
                                   registry=r)
        self._vector_labels: set[str] = set()  # the vector label's values (_vector_label)
        self.control_requests = Counter(
            "attnserve_control_vector_requests", "Requests that steered with each control "
            "vector (finished, cancelled or failed); unsteered requests are not counted.",
            ["vector"], registry=r)
        self.control_tokens = Counter(
            "attnserve_control_vector_generated_tokens",
            "Tokens generated under each control vector.", ["vector"], registry=r)
        self.adapter_counts = AdapterCounts(self.adapter_labels)
        r.register(self.adapter_counts)  # a custom collector: read at scrape
        self.lora_resident = Gauge("attnserve_lora_resident",
                                   "LoRA adapters in a slot of the adapter graph now.",
                                   registry=r)
        self.lora_resident_bytes = Gauge(
            "attnserve_lora_resident_bytes", "Bytes of the resident adapters' own tensors.",
            registry=r)
        self.info = Gauge("attnserve_model_info", "The served model and the graph its "
                          "passes run, on whose kernels (value is always 1).",
                          ["model", "provider", "artifact_sha256", "decode_graph", "kernel"],
                          registry=r)
        self.lora_info = LoraRequestsInfo()
        r.register(self.lora_info)  # a custom collector: read at scrape
        self.cache_config = Gauge(
            "attnserve_cache_config_info", "The prefix cache's geometry, for a gateway's "
            "prefix-aware scoring: tokens a block, blocks it holds (value is always 1).",
            ["block_size", "num_gpu_blocks"], registry=r)

    def watch_kv_resident(self, read: Callable[[], int]) -> None:
        """Read the pool's resident bytes when /metrics is scraped (it takes a mincore walk
        over the pool's pages, too slow for every engine step)."""
        self.kv_resident.set_function(read)

    def watch_adapters(self, adapters: AdapterSet) -> None:
        """Read the adapters' loads, evictions and residency when /metrics is scraped."""
        self.adapter_counts.source = adapters.counts
        self.lora_info.adapters = adapters
        self.lora_resident.set_function(lambda: len(adapters.resident()))
        self.lora_resident_bytes.set_function(adapters.resident_bytes)

    def set_cache_config(self, block_size: int, blocks: int) -> None:
        """The prefix cache's geometry (called once it exists; no series without one)."""
        self.cache_config.labels(block_size=str(block_size), num_gpu_blocks=str(blocks)).set(1)

    def allow_adapter(self, name: str, configured: bool = False) -> None:
        """``name`` is served (--lora-modules, or loaded at run time): it may be a label."""
        self.adapter_labels.allow(name, configured)

    def set_model_info(self, model: str, provider: str, artifact_sha256: str,
                       decode_graph: str, kernel: str) -> None:
        """Called once the sessions exist, when the active provider and the graph the
        steps run (the graph table's entry the runner bound) are known."""
        self.info.labels(model=model, provider=provider, artifact_sha256=artifact_sha256,
                         decode_graph=decode_graph, kernel=kernel).set(1)

    # -- HTTP layer -------------------------------------------------------------------

    def record_http(self, route: str, status: str, seconds: float) -> None:
        self.requests.labels(route=route, status=status).inc()
        self.e2e.labels(route=route).observe(seconds)

    def record_rejection(self, reason: str) -> None:
        self.rejected.labels(reason=reason).inc()

    def record_admission(self, stats: AdmissionStats) -> None:
        self.admitted.labels(route=stats.route, state="running").set(stats.running)
        self.admitted.labels(route=stats.route, state="waiting").set(stats.waiting)

    # -- engine StatsSink -------------------------------------------------------------

    def record_step(self, stats: StepStats) -> None:
        if stats.phase == "prefill":
            self.prefill.observe(stats.duration)
            self.prompt_tokens.inc(stats.tokens)
            self.generation_tokens.inc(stats.batch_size)  # prefill yields each row's first token
        else:
            self.decode.observe(stats.duration)
            self.batch_size.observe(stats.batch_size)
            self.generation_tokens.inc(stats.tokens)

    def record_step_failure(self, kind: StepFailure) -> None:
        self.step_failures.labels(kind=kind).inc()

    def record_load(self, stats: LoadStats) -> None:
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        kv = stats.kv
        self.kv_tokens.set(kv.tokens)
        self.kv_usage.set(min(1.0, kv.tokens / kv.capacity_tokens))
        self.kv_slots.set(kv.slots)
        self.kv_slots_used.set(kv.slots_used)
        self.kv_capacity.set(kv.capacity_tokens)
        self.kv_bytes.set(kv.bytes_allocated)
        self.kv_moves.set(kv.rows_moved)
        self.prefilling.set(stats.prefilling)
        prefix = stats.prefix_cache
        if prefix is not None:
            queries, hits, evictions = self._prefix_seen
            self.prefix_queries.inc(prefix.queries - queries)
            self.prefix_hits.inc(prefix.hits - hits)
            self.prefix_evictions.inc(prefix.evictions - evictions)
            self._prefix_seen = (prefix.queries, prefix.hits, prefix.evictions)
            self.prefix_hit_rate.set(prefix.hits / prefix.queries if prefix.queries else 0.0)
            self.prefix_blocks.set(prefix.blocks)
            self.prefix_capacity.set(prefix.capacity_blocks)
            self.prefix_bytes.set(prefix.bytes_allocated)
        spec = stats.speculation
        if spec is not None:
            drafts, tokens, accepted, per_pos, paused = self._spec_seen
            self.spec_drafts.inc(spec.drafts - drafts)
            self.spec_draft_tokens.inc(spec.draft_tokens - tokens)
            self.spec_accepted.inc(spec.accepted_tokens - accepted)
            self.spec_paused_steps.inc(spec.paused_steps - paused)
            for i, count in enumerate(spec.accepted_per_position):
                seen = per_pos[i] if i < len(per_pos) else 0
                self.spec_accepted_per_pos.labels(position=str(i)).inc(count - seen)
            self._spec_seen = (spec.drafts, spec.draft_tokens, spec.accepted_tokens,
                               spec.accepted_per_position, spec.paused_steps)

    def record_queue(self, waiting: int) -> None:
        self.waiting.set(waiting)

    def record_request(self, stats: RequestStats) -> None:
        if stats.queue_time is not None:
            self.queue_time.observe(stats.queue_time)
        if stats.time_to_first_token is not None:
            self.ttft.observe(stats.time_to_first_token)
        for gap in stats.inter_token_latencies:
            self.itl.observe(gap)
        if stats.adapter is not None:
            label = self.adapter_labels.of(stats.adapter)
            self.lora_requests.labels(adapter=label).inc()
            self.lora_tokens.labels(adapter=label).inc(stats.generated_tokens)
        if stats.control_vector is not None:
            label = self._vector_label(stats.control_vector)
            self.control_requests.labels(vector=label).inc()
            self.control_tokens.labels(vector=label).inc(stats.generated_tokens)

    def _vector_label(self, name: str) -> str:
        """``name``, for the first MAX_VECTOR_LABELS names seen; "other" after them, so
        vectors loaded and unloaded at run time cannot grow the exposition without bound."""
        if name not in self._vector_labels and len(self._vector_labels) < MAX_VECTOR_LABELS:
            self._vector_labels.add(name)
        return name if name in self._vector_labels else "other"

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
