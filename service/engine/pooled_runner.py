"""What both runners share: the KV pool, the prefix cache, and the rows' bookkeeping.

A runner owns one ``KVPool`` (kv_pool.py): a row is a ``Slot`` and the pool's ``lengths``
say how many of its tokens are cached, so a row's next position is its length and
rolling a row back (``truncate``) is setting it lower. The pool's memory is checked
against the token budget (``PoolConfig.budget_tokens``), not slots x max_len: the
scheduler's admission never lets more tokens in than the budget.

``run`` executes a step's plan (step_plan.py): it packs the plan's rows into passes by
what GroupQueryAttention takes and calls the passes subclasses supply for their graph,
all private and all over the plan's rows (``RowWork``: slot, tokens, what it wants back,
its adapter, its control vector): ``_prefill`` (rows of several tokens: whole prompts
into empty slots, batched, or one row after its cache), ``_decode`` (one token a row)
and, where the graph takes a second group of rows, ``_mixed_pass`` (the decode rows and
one more group in one pass). Each runner packs any of them with its one packer.
``reserve`` is where rows take KV memory: empty slots, loaded with each prompt's cached
prefix. ``_arrange`` lays a batch's slots out as the graph needs them
(engine.onnx binds one run of consecutive slots; model.onnx gathers, so anything goes).
The pool and the prefix cache keep no per-row attribute: a prefix is looked up, saved and
loaded under the ``ModelVariant`` the caller names for the row (its LoRA adapter).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from service.contract import io_spec as io
from service.engine.adapters import AdapterSet, UnknownAdapter
from service.engine.control_vectors import ControlVectors, UnknownControlVector
from service.engine.cuda import SampledRows
from service.engine.kv_pool import KVPool, PoolShape, Slot, ensure_memory
from service.engine.prefix_cache import PrefixCache
from service.engine.request import BASE, GenerationRequest, ModelVariant
from service.engine.runner import PoolConfig
from service.engine.stats import KVStats, PrefixCacheStats
from service.engine.step_plan import PassTime, RowDraw, RowWork, StepPlan, StepResult


class PooledRunner:
    """The pool-owning half of a ModelRunner; see runner.py for the contract."""

    vocab_size: int
    graph_file: str
    provider: str
    device: str
    mixes_chunks: bool = False  # a second group of rows rides in the decode pass
    samples_on_device: bool = False  # decoding rows may want draws made beside the logits
    adapters: AdapterSet | None = None  # the LoRA adapters its graph applies per row
    control_vectors: ControlVectors | None = None  # the control vectors it adds per row

    @property
    def float32_pass_tokens(self) -> int | None:
        """No float32 weights for long passes here (EngineGraphRunner may have them)."""
        return None

    def __init__(self, config: io.ArtifactConfig, pool: PoolConfig, dtype: np.dtype,
                 device: str = "cpu") -> None:
        """``device`` "cuda": the pool in GPU memory (cuda.py), no prefix cache."""
        self.config = config
        self.vocab_size = config.vocab_size
        self.max_len = pool.max_len or config.max_seq_len
        if not 1 < self.max_len <= config.max_seq_len:
            raise ValueError(f"KV pool slots of {self.max_len} tokens: must be 2.."
                             f"{config.max_seq_len} (the model's context)")
        self.shape = PoolShape(2 * config.n_layers, config.kv_heads, self.max_len,
                               config.head_dim, dtype)
        virtual = pool.slots * self.max_len
        self._budget = min(pool.budget_tokens, virtual) if pool.budget_tokens else virtual
        token_bytes = self.shape.token_bytes
        self.prefix: PrefixCache | None = None
        if device != "cpu":  # allocated whole, where ONNX Runtime's allocator says if it fits
            from service.engine.cuda import DeviceKVPool

            self.pool: KVPool = DeviceKVPool(self.shape, pool.slots)
            return
        ensure_memory(self._budget * token_bytes
                      + pool.prefix_cache_blocks * pool.prefix_block_size * token_bytes,
                      f"a budget of {self._budget:,} tokens x {token_bytes:,} bytes "
                      f"({pool.slots} slots of up to {self.max_len} tokens), plus the "
                      "prefix cache")
        self.pool = KVPool(self.shape, pool.slots)
        if pool.prefix_cache_blocks > 0:
            self.prefix = PrefixCache(self.pool, pool.prefix_block_size,
                                      pool.prefix_cache_blocks)

    @property
    def capacity(self) -> int:
        return self.pool.slots

    @property
    def budget_tokens(self) -> int:
        return self._budget

    @property
    def rows_used(self) -> int:
        return self.pool.used

    def cached_length(self, slot: Slot) -> int:
        return int(self.pool.lengths[slot.index])

    def kv_resident_bytes(self) -> int:
        return self.pool.resident_bytes

    # -- rows ------------------------------------------------------------------------

    def reserve(self, rows: int, top: bool = False,
                prompts: Sequence[np.ndarray | None] | None = None,
                variants: Sequence[ModelVariant] | None = None) -> list[Slot]:
        if variants is not None:
            self._check_variants(variants)
        if variants is not None and len(variants) != rows:
            raise ValueError(f"{len(variants)} variants for {rows} rows")
        slots = self.pool.allocate(rows, top)
        if prompts is None or self.prefix is None:
            return slots
        if len(prompts) != rows:
            raise ValueError(f"{len(prompts)} prompts for {rows} rows")
        keys = list(variants or [BASE] * rows)
        hits = [0 if p is None else self.prefix.match(np.asarray(p, np.int64), key)
                for p, key in zip(prompts, keys, strict=True)]
        # the rows that reuse nothing first, in order: engine.onnx prefills one run of them
        order = sorted(range(rows), key=lambda r: bool(hits[r]))
        self.pool.assign([slots[r] for r in order], sorted(s.index for s in slots))
        for r in range(rows):
            prompt = prompts[r]
            if hits[r] and prompt is not None:
                self.prefix.load(np.asarray(prompt, np.int64), slots[r].index, keys[r])
        return slots

    def resolve(self, requests: Sequence[GenerationRequest]) -> None:
        """What each request names that its rows run under, resolved against what this
        runner serves, all or none: its control vector (UnknownControlVector; one unloaded
        later keeps serving the rows that resolved it) and its LoRA adapter (UnknownAdapter),
        counted in flight until :meth:`release` (an unload waits for it). The request's
        ``variant`` is then what its rows carry (a new per-row input naming a served thing
        is resolved here)."""
        steering = []
        for r in requests:
            if r.control_vector is not None:
                if self.control_vectors is None:
                    raise UnknownControlVector(r.control_vector.name)
                steering.append((r, self.control_vectors.resolve(r.control_vector)))
        try:
            for r in requests:
                if r.adapter_name is not None:
                    if self.adapters is None:
                        raise UnknownAdapter(r.adapter_name)
                    r.adapter = self.adapters.begin(r.adapter_name)
        except UnknownAdapter:
            for r in requests:
                self.release(r)
                r.adapter = None
            raise
        for r, resolved in steering:
            r.steering = resolved

    def release(self, request: GenerationRequest) -> None:
        """The request has left: :meth:`resolve`'s count of its adapter in flight ends."""
        if request.adapter is not None and self.adapters is not None:
            self.adapters.end(request.adapter)

    def _check_variants(self, variants: Sequence[ModelVariant]) -> None:
        """ValueError for a row under an adapter or control vector the graph cannot apply."""
        if self.adapters is None and any(v.adapter for v in variants):
            raise ValueError(f"{type(self).__name__} serves no LoRA adapter")
        if self.control_vectors is None and any(v.steering for v in variants):
            raise ValueError(f"{type(self).__name__} applies no control vector")

    def truncate(self, slot: Slot, length: int) -> None:
        self.pool.truncate(slot, length)  # pages past ``length`` go back to the OS

    def leave(self, slots: Sequence[Slot], keep: Sequence[int],
              variants: Sequence[ModelVariant] | None = None) -> list[Slot]:
        if not slots:
            return []
        kept_rows = {int(r) for r in keep}
        start = min(s.index for s in slots)  # the batch's run begins here, and stays
        dropped = [i for i in range(len(slots)) if i not in kept_rows]
        if self.prefix is not None:
            for i in dropped:  # what the request generated may start the next turn's prompt
                self.prefix.save(slots[i].index, variants[i] if variants else BASE)
        self.pool.free([slots[i] for i in dropped])
        kept = [slots[int(r)] for r in keep]
        if kept:
            self._arrange(kept, start)
        return kept

    def join(self, groups: Sequence[Sequence[Slot]]) -> list[Slot]:
        slots = [s for group in groups for s in group]
        self._arrange(slots, None)
        return slots

    def _arrange(self, slots: Sequence[Slot], start: int | None) -> None:
        """Lay a batch's slots out for the graph (default: wherever they are)."""

    def settle(self) -> None:
        """Bring the pool's arrays up to date with every pass so far. A runner that keeps
        a steady batch's newest columns elsewhere (model.onnx under CUDA) writes them back
        here and before any call that reads or moves rows; the default has none."""

    # -- a step --------------------------------------------------------------------

    def run(self, plan: StepPlan) -> StepResult:
        """Execute a step's plan (runner.py), packing its rows into passes by what the
        graph takes, as each row says: rows of one token after their cache decode
        together; ``first`` rows (prompts into empty slots) prefill together, one pass per
        run of slots the graph binds at once (``_prompt_runs``: a step's newcomers are one
        run, a long prompt's first chunk, reserved at the top of the pool, another); any
        other row of several tokens (a chunk, the rest of a prompt after a cached prefix,
        drafts to verify) is a pass of its own, as GroupQueryAttention runs such a row
        only alone. Where the graph takes a second group of rows (``mixes_chunks``), one
        such row, or else the first run of first prompts, wanting the last logits, ride in
        the decode rows' pass. The order: that pass, first prompts, the other rows of
        several tokens, the decode rows, then the drafted rows."""
        rows = plan.rows
        if len({r.slot.index for r in rows}) != len(rows):
            raise ValueError("a row appears twice in one step")
        if any(len(r.tokens) == 0 for r in rows):
            raise ValueError("every row of a step feeds at least one token")
        self._check_variants([r.variant for r in rows])
        out = StepResult([np.empty(0)] * len(rows))
        first = [i for i, r in enumerate(rows) if r.first]
        decode = [i for i, r in enumerate(rows) if not r.first and len(r.tokens) == 1]
        alone = [i for i, r in enumerate(rows) if not r.first and len(r.tokens) > 1]
        runs = [[first[j] for j in run]  # first rows, by the pass taking them
                for run in self._prompt_runs([rows[i].slot for i in first])]
        rider: list[int] = []
        if decode and self.mixes_chunks:  # the second group returns the last logits
            rider = next(([i] for i in alone if rows[i].want == "last"), [])
            if not rider and runs and all(rows[i].want == "last" for i in runs[0]):
                rider = runs[0]
        if rider:
            with _timed(out, decode + rider):
                self._mixed_pass(rows, decode, rider, out)
            decode = []
        for run in runs:
            if run != rider:
                with _timed(out, run):
                    self._first_prompts(rows, run, out)
        for i in [i for i in alone if not rows[i].drafted and i not in rider]:
            with _timed(out, [i]):
                self._extend_row(rows[i], i, out)
        if decode:
            with _timed(out, decode):
                self._decode_pass(rows, decode, out)
        for i in [i for i in alone if rows[i].drafted]:
            with _timed(out, [i]):
                self._extend_row(rows[i], i, out)
        return out

    def _extend_row(self, work: RowWork, i: int, out: StepResult) -> None:
        """A row of several tokens after its cache, alone."""
        logits = self._prefill([work], every=work.want == "every")[0]
        out.outputs[i] = self._delivered(work, logits)
        if not work.drafted:
            self._save_prefix([work])

    def _prompt_runs(self, slots: Sequence[Slot]) -> list[list[int]]:
        """Empty ``slots`` (a step's rows into them) grouped by the prefill passes that
        take them, as indices into ``slots``. By default one pass takes them all: the
        graph gathers each row's cache wherever it sits (model.onnx)."""
        return [list(range(len(slots)))] if slots else []

    def _first_prompts(self, rows: Sequence[RowWork], first: list[int], out: StepResult
                       ) -> None:
        """Rows into empty slots (one of ``_prompt_runs``), prefilled together."""
        prompts = [rows[i] for i in first]
        self.pool.assign([r.slot for r in prompts], sorted(r.slot.index for r in prompts))
        every = any(r.want == "every" for r in prompts)
        logits = self._prefill(prompts, every)
        for i, got in zip(first, logits, strict=True):
            out.outputs[i] = self._delivered(rows[i], got)
        self._save_prefix(prompts)

    def _decode_pass(self, rows: Sequence[RowWork], decode: list[int], out: StepResult
                     ) -> None:
        """One token a row; the tokens themselves where every row wants only those."""
        decoding = [rows[i] for i in decode]
        wants = {r.want for r in decoding}
        if wants <= {"argmax", "draw"}:
            ids = self._decode_ids(decoding, _draws(decoding)
                                   if "draw" in wants else None)  # (B,)
            for j, i in enumerate(decode):
                out.outputs[i] = ids[j:j + 1]
            out.together[tuple(decode)] = ids
            return
        self._deliver_decoded(rows, decode, self._decode(decoding), out)  # (B, V)

    def _deliver_decoded(self, rows: Sequence[RowWork], decode: list[int],
                         logits: np.ndarray, out: StepResult) -> None:
        """The decode rows' outputs from their logits (B, V)."""
        if all(rows[i].want == "last" for i in decode):
            out.together[tuple(decode)] = logits
        drawn = [j for j, i in enumerate(decode) if rows[i].want == "draw"]  # pass rows
        if drawn:  # (D,) each drawn row's token, beside the logits
            draws = self._draw(logits[drawn], _draws([rows[decode[j]] for j in drawn]))
            for d, j in enumerate(drawn):
                out.outputs[decode[j]] = draws[d:d + 1]
        for j, i in enumerate(decode):
            if rows[i].want != "draw":
                out.outputs[i] = self._delivered(rows[i], logits[j:j + 1])

    @staticmethod
    def _delivered(work: RowWork, logits: np.ndarray) -> np.ndarray:
        """What the row wants of its logits (T or 1, V)."""
        if work.want == "every":
            return logits
        if work.want == "argmax":
            return logits[-1:].argmax(-1)  # (1,)
        if work.want == "draw":
            raise ValueError("draws come from a decode pass on a runner that samples")
        return logits[-1:]  # (1, V)

    def _mixed_pass(self, rows: Sequence[RowWork], decode: list[int], rider: list[int],
                    out: StepResult) -> None:
        """The decode rows and ``rider`` (one row after its cache, or first prompts) in
        one pass over the weights (graphs that take a second group of rows only)."""
        raise ValueError(f"{type(self).__name__} runs one group of rows a pass")

    def _draw(self, logits: np.ndarray, sampled: SampledRows) -> np.ndarray:
        """Each row's draw (B,) from its logits (B, V): runners that sample beside the
        logits (``samples_on_device``) only."""
        raise ValueError(f"{type(self).__name__} samples on the host")

    def _save_prefix(self, rows: Sequence[RowWork]) -> None:
        """The rows' full blocks not cached yet go to the prefix cache, under each row's
        variant: after a prompt pass, and after each chunk of a chunked prompt (a chunk's
        worth at a time, not a long prompt's whole copy in the step that ends it)."""
        if self.prefix is not None:
            for r in rows:
                self.prefix.save(r.slot.index, r.variant)

    # -- the passes a graph supplies ---------------------------------------------------

    def _prefill(self, rows: Sequence[RowWork], every: bool) -> list[np.ndarray]:
        """Rows of several tokens after their caches, in one pass (whole prompts into empty
        slots, or a single row after its cache: GroupQueryAttention takes no other mix):
        each row's logits, (T_i, V) with ``every``, else (1, V)."""
        raise NotImplementedError

    def _decode(self, rows: Sequence[RowWork]) -> np.ndarray:
        """One token after each row's cache (each row's ``tokens``, of one): logits (B, V)."""
        raise NotImplementedError

    def _decode_ids(self, rows: Sequence[RowWork], sampled: SampledRows | None) -> np.ndarray:
        """``_decode``'s next token per row, (B,) int64: the argmax, or the draws of
        ``sampled`` (``samples_on_device`` runners only). A runner whose graph picks the
        tokens itself (a float16 engine graph on the GPU) copies only those."""
        if sampled is not None:
            raise ValueError(f"{type(self).__name__} samples on the host")
        return self._decode(rows).argmax(-1)

    def _check_room(self, total: int) -> None:
        if total > self.max_len:
            raise ValueError(f"sequence of {total} tokens exceeds max_seq_len {self.max_len}")

    def _record(self, slot: int, start: int, tokens: np.ndarray) -> None:
        """The ids of tokens just cached at [start, start + T) of ``slot``."""
        end = start + len(tokens)
        self.pool.tokens[slot, start:end] = tokens
        self.pool.lengths[slot] = end

    # -- stats -----------------------------------------------------------------------

    def kv_stats(self) -> KVStats:
        pool = self.pool
        return KVStats(slots=pool.slots, slots_used=pool.used, tokens=pool.tokens_held,
                       capacity_tokens=self._budget, bytes_allocated=pool.bytes_allocated,
                       rows_moved=pool.moves)

    def prefix_stats(self) -> PrefixCacheStats | None:
        if self.prefix is None:
            return None
        c = self.prefix.counters
        return PrefixCacheStats(queries=c.queries, hits=c.hits, blocks=self.prefix.blocks_used,
                                capacity_blocks=self.prefix.capacity,
                                block_size=self.prefix.block_size,
                                bytes_allocated=self.prefix.bytes_allocated,
                                evictions=c.evicted)


@contextmanager
def _timed(out: StepResult, rows: Sequence[int]) -> Iterator[None]:
    """Record what the block took as one pass carrying the plan's ``rows``."""
    started = time.perf_counter()
    yield
    out.passes.append(PassTime(tuple(rows), time.perf_counter() - started))


def _draws(rows: Sequence[RowWork]) -> SampledRows:
    """The rows' draws as the device sampler takes them (greedy rows: top-k 1)."""
    draws = [r.draw or GREEDY_DRAW for r in rows]
    return SampledRows(temperature=np.array([d.temperature for d in draws], np.float32),
                       top_k=np.array([d.top_k for d in draws], np.int64),
                       top_p=np.array([d.top_p for d in draws], np.float32),
                       u=np.array([d.u for d in draws], np.float32))


GREEDY_DRAW = RowDraw(temperature=1.0, top_k=1, top_p=2.0, u=0.0)
