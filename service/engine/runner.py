"""The one interface between the scheduler and a decoder graph: ``ModelRunner``.

Everything the batch and the scheduler ask of a model is stated here, typed, so nothing
probes a runner for optional features: one method runs a step (``run``: a flat list of
rows, each feeding tokens after its cache, service/engine/step_plan.py), the others
manage rows. A row of a batch is a
``Slot`` of the runner's ``KVPool`` (service/engine/kv_pool.py), which is the only owner
of keys and values: the runner reads a row's cached length from the pool, feeds the new
tokens after it and writes their keys and values back, so the batch holds no cache and
no padding. Each runner lays out its own inputs (engine.onnx right-pads, model.onnx
left-pads).

Two runners implement it: ``EngineGraphRunner`` (engine.onnx, pool slots bound in place;
engine_graph_runner.py) and ``ModelGraphRunner`` (model.onnx, the portable graph, past gathered
from the pool every step; model_graph_runner.py), both over ``PooledRunner`` (pooled_runner.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from service.contract.graphs import GraphEntry
from service.engine.kv_pool import Slot
from service.engine.request import GenerationRequest, ModelVariant
from service.engine.stats import KVStats, PrefixCacheStats
from service.engine.step_plan import StepPlan, StepResult
from service.settings import default_of

if TYPE_CHECKING:
    from service.engine.adapters import AdapterSet
    from service.engine.control_vectors import ControlVectors


@dataclass(frozen=True)
class PoolConfig:
    """Size of a runner's KV pool and prefix cache."""

    slots: int  # rows the pool holds: the largest batch the scheduler may form
    prefix_block_size: int = default_of("prefix_block_size")
    prefix_cache_blocks: int = 0  # 0: no prefix caching
    max_len: int | None = None  # tokens per slot (max_total_tokens); None: the model context
    budget_tokens: int | None = None  # tokens the pool may hold at once; None: slots x max_len


class ModelRunner(Protocol):
    """A decoder over a KV pool: what the batch and the scheduler call, and nothing else."""

    vocab_size: int
    graph_file: str  # model.onnx or engine.onnx
    provider: str  # ONNX Runtime's active execution provider
    device: str  # "cpu" or "cuda": where the session runs
    mixes_chunks: bool  # a row after its cache, or first prompts, ride in the decode pass
    samples_on_device: bool  # decoding rows may want draws (``RowWork.want`` "draw")
    adapters: AdapterSet | None  # the LoRA adapters its graph applies per row, if any
    control_vectors: ControlVectors | None  # the control vectors it adds per row, if any
    graphs: tuple[GraphEntry, ...]  # the artifact's graphs it runs (contract/graphs.py)

    def resolve(self, requests: Sequence[GenerationRequest]) -> None:
        """What each request names (its adapter, its control vector) resolved against what
        the runner serves, all or none; UnknownAdapter / UnknownControlVector otherwise."""
        ...

    def release(self, request: GenerationRequest) -> None:
        """The request has left: what :meth:`resolve` holds for it goes."""
        ...

    @property
    def float32_pass_tokens(self) -> int | None:
        """Passes of this many tokens or more run on float32 weights (service/contract/
        graphs.py); None: never."""
        ...

    @property
    def capacity(self) -> int:
        """Rows the runner can hold at once (the pool's slots)."""
        ...

    @property
    def budget_tokens(self) -> int:
        """Tokens the pool may hold at once, over all rows (the KV memory budget)."""
        ...

    @property
    def max_len(self) -> int:
        """Tokens one row can hold."""
        ...

    @property
    def rows_used(self) -> int:
        """Rows holding a sequence now."""
        ...

    def cached_length(self, slot: Slot) -> int:
        """Tokens of row ``slot`` in the cache."""
        ...

    def kv_resident_bytes(self) -> int:
        """Bytes of the KV cache in RAM now (the pool's touched pages)."""
        ...

    def reserve(self, rows: int, top: bool = False,
                prompts: Sequence[np.ndarray | None] | None = None,
                variants: Sequence[ModelVariant] | None = None) -> list[Slot]:
        """Slots for new rows (``top``: away from the running rows): the one place rows
        take KV memory. With ``prompts``, each row's slot holds its prompt's cached prefix
        computed under the row's ``variants`` entry (None: the base) where the prefix
        cache has one (``cached_length`` says how much; None: not looked up), and the rows
        that reuse nothing come first, in one consecutive run. The slot keeps no variant:
        every pass reads it from the row (``RowWork.variant``)."""
        ...

    def run(self, plan: StepPlan) -> StepResult:
        """Execute one step's plan (step_plan.py): every row, packed into as few passes as
        the runner's graphs allow, choosing the graph for each pass itself. The rows'
        cached lengths and tokens are up to date when it returns; each row's logits, or
        the token the runner picked, come back with the passes and what each took."""
        ...

    def truncate(self, slot: Slot, length: int) -> None:
        """Keep only the first ``length`` cached tokens of a row (drop rejected drafts)."""
        ...

    def leave(self, slots: Sequence[Slot], keep: Sequence[int],
              variants: Sequence[ModelVariant] | None = None) -> list[Slot]:
        """Rows not in ``keep`` leave: their blocks go to the prefix cache, under each
        row's variant (``variants``, one per slot; None: the base), and their slots are
        freed. The kept slots, in ``keep`` order, laid out as the runner needs."""
        ...

    def join(self, groups: Sequence[Sequence[Slot]]) -> list[Slot]:
        """One batch's slots from several batches' (in order), laid out as the runner needs."""
        ...

    def kv_stats(self) -> KVStats: ...

    def prefix_stats(self) -> PrefixCacheStats | None: ...
