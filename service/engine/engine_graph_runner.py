"""engine.onnx behind the ModelRunner protocol: the KV pool's slots written in place.

model.onnx returns a new, one-column-longer present for every layer at every step
(Concat of past and new). engine.onnx instead takes one preallocated cache per layer,
(B, nh, max_seq_len, hs), as both past and present, and its GroupQueryAttention writes
the new keys and values into it in place. Here that cache is a run of slots of the
runner's KVPool (service/engine/kv_pool.py), bound by pointer: nothing is allocated per
request and nothing is copied per step.

Each row's tokens start at column 0 of its slot and the pool's ``lengths`` say how many
are cached, which is what the kernel reads (``seqlens_k``); inputs are right-padded. A
batch's rows must sit in consecutive slots: joining compacts them, and a leave moves at
most one row (``KVPool.compact``). Rows with empty slots are prefilled together
(GroupQueryAttention's first-prompt mode); a multi-token step over a non-empty cache
(a reused prefix, a prompt chunk, drafted tokens) runs one row at a time, as ONNX
Runtime supports it.

Each pass names the positions whose logits it needs (``logits_index``: a decode step's
one token, a prompt's last, every token only for prompt logprobs or drafted tokens), so
the LM head runs on those rows alone, and the logits land in a numpy array of exactly
that size, bound as the output: ONNX Runtime's arena never holds them. A multi-token
pass also asks the arena to give its activations back to the OS once done
(``memory.enable_memory_arena_shrinkage``), so one long prompt does not raise the
process's memory for good. An engine.onnx exported before ``logits_index`` computes every
position's logits; its wanted rows are picked out here.

A quantised artifact may carry the same graph with float32 weights as well
(engine_float32.onnx, its weights already in weights.bin; service/contract/graphs.py is the
table of which graph runs which pass). ONNX Runtime's MatMulNBits beats a float32 GEMM by
5x at one row but loses to it from a few dozen rows on (docs/engine.md), so a pass of at
least the table's ``from_tokens`` tokens (a long prompt, a prompt chunk with the decode
rows) runs on float32 weights. They are not packed: ONNX Runtime reads them where it
memory-mapped weights.bin, so they cost page cache shared with the file rather than a
private copy, and it packs each weight per call, which a pass of hundreds of rows hides.
Every session writes the same pool.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from service.contract import adapter_spec
from service.contract import engine_spec as es
from service.contract import io_spec as io
from service.contract.graphs import GraphEntry, GraphInterface, graph_for_pass
from service.engine.adapters import (
    AdapterLimits,
    AdapterSet,
    AdapterSlots,
    adapter_widths,
)
from service.engine.control_vectors import ControlVectors
from service.engine.cuda import UNCAPTURED, CapturedDecode, DeviceSampler, SampledRows
from service.engine.kv_pool import Slot
from service.engine.pooled_runner import PooledRunner
from service.engine.request import Steering
from service.engine.runner import PoolConfig
from service.engine.step_plan import RowWork, StepResult

log = logging.getLogger("attnserve.engine")


class EngineGraphRunner(PooledRunner):
    """ModelRunner over engine.onnx with a persistent KV pool on the host (of the cache type
    the steps graph's entry names: float32, or float16)."""

    def __init__(self, session: ort.InferenceSession, config: io.ArtifactConfig,
                 pool: PoolConfig,
                 long_passes: Mapping[GraphEntry, ort.InferenceSession] | None = None,
                 device: str = "cpu", cuda_graphs: bool = False,
                 adapter_limits: AdapterLimits | None = None, steps: GraphEntry | None = None
                 ) -> None:
        """``session``: the graph of every pass (engine.onnx or engine_mixed.onnx);
        ``long_passes``: the artifact's float32-weights graph, for passes of at least its
        entry's ``from_tokens`` tokens (module docstring); one that cannot run the steps
        graph's passes is left out, said in one line. ``device`` "cuda": a float16
        graph on the CUDA provider, the pool in device memory, decode steps replayed as
        CUDA graphs with ``cuda_graphs`` (the session must have been created with them;
        cuda.py). An adapter graph (``<stem>_lora.onnx``) applies each row's LoRA adapter,
        in as many slots of which rank as ``adapter_limits`` says (default: the settings'
        defaults; adapters.py). ``steps``: ``session``'s entry in the artifact's graph
        table, what every pass and /info read of it; None (a session built by hand): the
        entry its inputs describe."""
        n = config.n_layers
        interface = GraphInterface.of_session(session)
        missing = sorted(({*es.engine_input_names(n)} - interface.inputs)
                         | ({*es.engine_output_names(n)} - interface.outputs))
        missing = [name for name in missing if name not in es.GATHERED_INPUTS]
        if missing:
            raise ValueError(f"{es.ENGINE_FILE} lacks {missing}")
        self._shrink = ort.RunOptions()  # for multi-token passes: the arena gives back
        self._shrink.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        self._plain = ort.RunOptions()  # every other pass
        if cuda_graphs:  # neither captured nor replayed: only decode steps are (cuda.py)
            for options in (self._shrink, self._plain):
                options.add_run_config_entry("gpu_graph_id", UNCAPTURED)
        steps = steps or GraphEntry.of_interface(interface, cuda=device != "cpu")
        super().__init__(config, pool, np.dtype(steps.kv_dtype), device)  # the pool's type
        self.session = session
        self.provider = session.get_providers()[0]
        self.device = device
        self._past, self._present = io.past_names(n), io.present_names(n)
        # which graph runs which pass: the table's entries this runner serves, steps first,
        # each read from its session and checked against it once (_Graph); every later
        # fact is the entry's or that interface's
        self._sessions = {steps.file: _Graph(steps, session, interface)}
        for graph, other in (long_passes or {}).items():
            bound = _Graph(graph, other, GraphInterface.of_session(other))
            if bound.interface.runs_passes_of(interface):
                self._sessions[graph.file] = bound
            else:
                log.info("%s does not take %s's inputs: not used", graph.file, steps.file)
        self.graphs: tuple[GraphEntry, ...] = tuple(g.entry for g in self._sessions.values())
        self.graph_file = steps.file
        # engine_mixed.onnx (export/onnx/engine_graph.py) has a second group of rows, so a
        # prompt chunk or newcomers' prompts ride along with a decode step: one read of
        # the weights for both.
        self.mixes_chunks = steps.mixes_chunks
        if device != "cpu" and (self.mixes_chunks or len(self.graphs) > 1):
            raise ValueError(f"on {device}, the engine runs {es.ENGINE_FILE} alone")
        self.float32_passes = 0  # passes run on float32 weights
        scratch = (1, self.shape.heads, 1, self.shape.head_dim)  # (1, nkv, 1, hs)
        self._scratch = [np.zeros(scratch, self.shape.dtype) for _ in self._past]
        self._scratch_pointers = [a.ctypes.data for a in self._scratch]
        self._captured: CapturedDecode | None = None
        self._sampler: DeviceSampler | None = None
        if cuda_graphs:  # on the CPU (tests): the same bindings, never captured
            self._captured = CapturedDecode(session, self.pool, n, self.vocab_size,
                                            device=device)
            self._sampler = DeviceSampler(device)
        self.samples_on_device = self._sampler is not None
        self.adapters = None
        if steps.adapters:
            if device != "cpu" or len(self.graphs) > 1 or cuda_graphs:
                raise ValueError("an adapter graph runs on the CPU, alone")
            widths = adapter_widths({i.name: i.shape for i in session.get_inputs()})
            self.adapters = AdapterSet(AdapterSlots(widths, adapter_limits or AdapterLimits()))
        elif adapter_limits is not None:
            raise ValueError("adapter slots for a graph that applies no LoRA adapter")
        # every engine graph exported since takes each row's control vector (``steer``, an
        # input with a default); a float16 one (CUDA) would take it in float16: not offered
        if device == "cpu" and all(g.interface.steers for g in self._sessions.values()):
            self.control_vectors = ControlVectors(n, config.d_model)
        self._no_steer = np.zeros((1, n, config.d_model), np.float32)  # steer's default

    @property
    def float32_pass_tokens(self) -> int | None:
        """Passes of this many tokens or more run on float32 weights; None: never."""
        return min((g.from_tokens for g in self.graphs if g.runs == "long passes"),
                   default=None)

    def _graph_for(self, tokens: int) -> _Graph:
        """The graph for a pass of ``tokens`` tokens (rows × padded length, both groups):
        the table's lookup."""
        graph = graph_for_pass(self.graphs, tokens)
        self.float32_passes += graph.weights == "float32"
        return self._sessions[graph.file]

    def _arrange(self, slots: Sequence[Slot], start: int | None) -> None:
        self.pool.compact(slots, start)

    def _prompt_runs(self, slots: Sequence[Slot]) -> list[list[int]]:
        """A pass binds one run of consecutive slots: the empty ``slots`` by runs, in slot
        order (each reservation is one run: ``KVPool.allocate``)."""
        runs: list[list[int]] = []
        for j in sorted(range(len(slots)), key=lambda j: slots[j].index):
            if runs and slots[j].index == slots[runs[-1][-1]].index + 1:
                runs[-1].append(j)
            else:
                runs.append([j])
        return runs

    def _run(self, rows: _Rows, chunk: _Rows | None = None
             ) -> tuple[np.ndarray, np.ndarray | None]:
        """One forward pass: logits (n, K, V) of ``rows`` and, in the mixed graph, of
        ``chunk``: one row's prompt chunk after its cache, or newcomers' whole prompts
        into empty slots, fed in the same pass (an idle row of no tokens when there is
        none). GroupQueryAttention takes several rows of T > 1 only as first prompts."""
        if chunk is not None and not self.mixes_chunks:
            raise ValueError(f"this {es.ENGINE_FILE} has no second group of rows: "
                             "feed the chunk in a pass of its own")
        if chunk is not None and len(chunk.ids) > 1 and chunk.total > chunk.ids.shape[1]:
            raise ValueError("several rows of the second group must all be first prompts")
        tokens = rows.ids.size + (chunk.ids.size if chunk is not None else 0)
        graph = self._graph_for(tokens)
        logits = self._bind(graph, rows, self.pool.pointers(rows.lo), self.max_len, "")
        chunk_logits = None  # bound as an output: must outlive the run
        if graph.entry.mixes_chunks:  # a twin may have a second group the main graph lacks
            if chunk is None:
                chunk_logits = self._bind(graph, _IDLE_ROW, self._scratch_pointers, 1,
                                          es.CHUNK_PREFIX)
            else:
                chunk_logits = self._bind(graph, chunk, self.pool.pointers(chunk.lo),
                                          self.max_len, es.CHUNK_PREFIX)
        groups = [rows, chunk or _IDLE_ROW] if graph.entry.mixes_chunks else [rows]
        if self.adapters is not None:
            self._bind_adapters(graph, groups)
        if self.control_vectors is not None:
            self._bind_steering(graph, groups)
        graph.session.run_with_iobinding(graph.binding, self._shrink
                                         if tokens > len(rows.ids) else self._plain)
        if not graph.interface.gathers_logits:  # (n, K, V) of an old graph's (n, T, V)
            logits = logits[np.arange(len(rows.ids))[:, None], rows.index]
        return logits, chunk_logits if chunk is not None else None

    def _bind(self, graph: _Graph, rows: _Rows, pointers: list[int], length: int,
              prefix: str) -> np.ndarray:
        """Bind one group's inputs, its KV run (past and present: the same memory, written
        in place) and its logits, an array of ours (freed with the caller's last reference,
        never cached by ONNX Runtime's arena). The binding lives as long as the runner and
        the KV run is bound again only when it changes: its 2 × layers calls cost about
        0.3 ms a pass on SmolLM2, and a steady batch, or an idle second group, keeps its run."""
        binding = graph.binding
        n, t = rows.ids.shape
        gathers = graph.interface.gathers_logits  # False: an engine graph of before it
        index = np.ascontiguousarray(rows.index, np.int64)  # (n, K)
        logits = np.empty((n, index.shape[1] if gathers else t, self.vocab_size),
                          np.float32)  # (n, K or T, V)
        if logits.size:
            binding.bind_output(prefix + io.LOGITS, "cpu", 0, np.float32,
                                list(logits.shape), logits.ctypes.data)
        else:  # no position wanted (the mixed graph's idle group): nothing to write
            binding.bind_output(prefix + io.LOGITS, "cpu")
        for name, value in es.engine_feed(rows.ids, rows.pos, rows.seqlens, rows.total,
                                          index if gathers else None, prefix).items():
            binding.bind_cpu_input(name, value)
        shape = [n, self.shape.heads, length, self.shape.head_dim]
        if graph.kv_bound.get(prefix) != (pointers[0], n, length):
            where = "cpu" if prefix else self.device  # the idle group's scratch: the host's
            for past, present, ptr in zip(self._past, self._present, pointers, strict=True):
                binding.bind_input(prefix + past, where, 0, self.shape.dtype, shape, ptr)
                binding.bind_output(prefix + present, where, 0, self.shape.dtype, shape, ptr)
            graph.kv_bound[prefix] = (pointers[0], n, length)
        if graph.interface.greedy_ids and not prefix:  # computed either way; left to ONNX Runtime
            binding.bind_output(es.GREEDY_IDS, "cpu")
        return logits

    def _bind_adapters(self, graph: _Graph, groups: Sequence[_Rows]) -> None:
        """The pass's LoRA mask, each token to its row's slot ((N, S·R), both groups'
        tokens in the graph's order), and the first S slots' A and B, S the highest slot
        a row uses (bound again only when S changes: the buffers are written in place).
        A pass of base rows binds none (S = 0): its updates are products over zero rows,
        which ONNX Runtime's MatMul defines as zeros, so it reads no adapter weight."""
        assert self.adapters is not None
        slots = self.adapters.slots
        per_token = np.concatenate([np.repeat(g.lora, g.ids.shape[1]) for g in groups])  # (N,)
        used = int(per_token.max(initial=0))
        mask = slots.mask(per_token, used)  # (N, used·R)
        graph.binding.bind_cpu_input(adapter_spec.LORA_MASK, mask)
        if graph.lora_bound != used:
            for name, view in slots.views(used).items():
                graph.binding.bind_input(name, "cpu", 0, np.float32, list(view.shape),
                                         view.ctypes.data)
            graph.lora_bound = used

    def _bind_steering(self, graph: _Graph, groups: Sequence[_Rows]) -> None:
        """The pass's ``steer``, (R, n_layers, d): each bound row's control vector table,
        both groups' rows in the graph's order, zeros for a row without; a pass where no
        row steers binds the graph's default (one row of zeros), once."""
        vectors = self.control_vectors
        assert vectors is not None
        steering = [s for g in groups for s in g.steering]
        if not any(steering):
            if graph.steer_bound is not self._no_steer:
                graph.bind_steer(self._no_steer)
            return
        zeros = self._no_steer[0]  # (L, d)
        graph.bind_steer(np.stack([zeros if s is None else vectors.table(s)
                                   for s in steering]))  # (R, L, d)

    def _decode(self, rows: Sequence[RowWork]) -> np.ndarray:
        packed, order = self._pack(rows)
        replayed = self._replay(packed, greedy_only=False)
        if replayed is not None and replayed[0] is not None:
            logits = replayed[0][:, None]  # (n, 1, V)
        else:
            logits, _ = self._run(packed)  # (n, 1, V)
        self._record_pass(packed, rows)
        return _in_row_order(order, logits[:, 0])  # (B, V)

    def _decode_ids(self, rows: Sequence[RowWork], sampled: SampledRows | None) -> np.ndarray:
        """``_decode`` with each row's next token chosen beside the logits: (B,) int64 in
        batch order, on a captured graph the only copy the step makes (cuda.py). Without
        ``sampled`` the argmax (the graph's own ``greedy_ids`` where it has them); with
        it, the sampler's draws."""
        packed, order = self._pack(rows)
        if sampled is not None:
            ids = self._sampled_ids(packed, order, sampled)
        else:
            replayed = self._replay(packed, greedy_only=True)
            if replayed is None:
                logits, _ = self._run(packed)  # (n, 1, V)
                self._record_pass(packed, rows)
                return _in_row_order(order, logits[:, 0]).argmax(-1)
            ids = replayed[1].astype(np.int64)  # (n,) in slot order
        self._record_pass(packed, rows)
        return _in_row_order(order, ids)

    def _draw(self, logits: np.ndarray, sampled: SampledRows) -> np.ndarray:
        """The sampler's draws (B,) from a mixed pass's logits (B, V), in batch order."""
        if self._sampler is None:
            raise ValueError("this runner samples on the host")
        return self._sampler.sample(logits, sampled)

    def _sampled_ids(self, rows: _Rows, order: np.ndarray | None, sampled: SampledRows
                     ) -> np.ndarray:
        """The sampler's draws (n,) in slot order, from the replayed step's logits on the
        device, or from a plain pass's where no graph fits."""
        sampler = self._sampler
        if sampler is None:
            raise ValueError("this runner samples on the host")
        if order is not None:  # bound row j is batch row order[j]
            sampled = SampledRows(*(column[order] for column in (
                sampled.temperature, sampled.top_k, sampled.top_p, sampled.u)))
        captured = self._captured
        bucket = captured.bucket_for(rows.lo, len(rows.ids)) if captured is not None else None
        if captured is not None and bucket is not None:
            return captured.sample(bucket, rows.ids[:, 0], rows.seqlens.astype(np.int32),
                                   sampler, sampled)
        logits, _ = self._run(rows)  # (n, 1, V)
        return sampler.sample(logits[:, 0], sampled)

    def _replay(self, rows: _Rows, greedy_only: bool
                ) -> tuple[np.ndarray | None, np.ndarray] | None:
        """A decode step on its bucket's captured CUDA graph, or None where none fits."""
        captured = self._captured
        if captured is None:
            return None
        bucket = captured.bucket_for(rows.lo, len(rows.ids))
        if bucket is None:
            return None
        return captured.run(bucket, rows.ids[:, 0], rows.seqlens.astype(np.int32),
                            greedy_only)

    @property
    def graph_replays(self) -> int:
        """Decode steps run from a captured CUDA graph so far."""
        return self._captured.replays if self._captured is not None else 0

    def _mixed_pass(self, rows: Sequence[RowWork], decode: list[int], rider: list[int],
                    out: StepResult) -> None:
        decoding, riding = [rows[i] for i in decode], [rows[i] for i in rider]
        group, order = self._pack(decoding)
        if riding[0].first:  # prompts into empty slots
            self.pool.assign([r.slot for r in riding], sorted(r.slot.index for r in riding))
        second, second_order = self._pack(riding)  # or one row after its cache
        logits, second_logits = self._run(group, second)  # (n, 1, V), (m, 1, V)
        assert second_logits is not None
        self._record_pass(second, riding)
        for i, last in zip(rider, _in_row_order(second_order, second_logits), strict=True):
            out.outputs[i] = last  # (1, V)
        self._save_prefix(riding)
        self._record_pass(group, decoding)
        self._deliver_decoded(rows, decode, _in_row_order(order, logits[:, 0]), out)

    def _pack(self, rows: Sequence[RowWork], every: bool = False
              ) -> tuple[_Rows, np.ndarray | None]:
        """The one packer: a group of a pass's ``rows`` as the graph's inputs. The rows
        are bound in slot order over one run of consecutive slots (compacted first where
        they are not): each row's tokens after its cache, right-padded to the longest,
        their positions, the positions whose logits are wanted (every fed one with
        ``every``, else each row's last), the slot of each row's adapter and its control
        vector. With it, the
        permutation from bound rows to ``rows`` (None: already in slot order). Several
        rows of more than one token are first prompts (GroupQueryAttention takes no other:
        ``run``'s packing never makes one, ``_run`` checks the second group)."""
        n = len(rows)
        slots = [r.slot for r in rows]
        lo, consecutive = self.pool.span(slots)
        if not consecutive:
            lo = self.pool.compact(slots)
        perm = np.argsort(np.fromiter((s.index for s in slots), np.int64, n))  # (n,)
        ordered = bool((perm == np.arange(n)).all())  # bound row j is rows[perm[j]]
        bound = rows if ordered else [rows[j] for j in perm]
        starts = self.pool.lengths[lo:lo + n].astype(np.int64)  # (n,) cached, a copy
        fed = np.fromiter((len(r.tokens) for r in bound), np.int64, n)  # (n,)
        totals = starts + fed  # (n,) each row's length after the pass
        width, total = int(fed.max()), int(totals.max())
        self._check_room(total)
        if width == 1:  # a decode group: one token a row, nothing padded
            ids = np.fromiter((r.tokens[0] for r in bound), np.int64, n)[:, None]  # (n, 1)
            pos = starts[:, None]  # (n, 1)
        else:
            ids = np.zeros((n, width), np.int64)  # (n, W) right-padded
            pos = np.zeros((n, width), np.int64)
            for j, r in enumerate(bound):
                ids[j, :fed[j]] = r.tokens
                pos[j, :fed[j]] = np.arange(starts[j], totals[j])
        index = (np.tile(np.arange(width, dtype=np.int64), (n, 1)) if every
                 else (fed - 1)[:, None])  # (n, W) or (n, 1)
        adapters = self.adapters
        lora = (np.zeros(n, np.int64) if adapters is None else  # (n,) 0: the base
                np.fromiter((adapters.slot_of(r.variant.adapter) for r in bound), np.int64, n))
        steering = tuple(r.variant.steering for r in bound)
        return (_Rows(lo, ids, pos, totals - 1, total, index, lora, steering),
                None if ordered else perm)

    def _record_pass(self, packed: _Rows, rows: Sequence[RowWork]) -> None:
        """The tokens a pass fed, in the pool: each row's ids at their positions and its
        length after them; the keys the kernel wrote for a row's padding given back."""
        lo, n = packed.lo, len(packed.ids)
        if packed.ids.shape[1] == 1:  # a decode group, bound in slot order
            self.pool.tokens[np.arange(lo, lo + n), packed.pos[:, 0]] = packed.ids[:, 0]
            self.pool.lengths[lo:lo + n] = packed.seqlens + 1
            return
        width = packed.ids.shape[1]
        for r in rows:
            end = int(packed.seqlens[r.slot.index - lo]) + 1
            self._record(r.slot.index, end - len(r.tokens), r.tokens)
            if len(r.tokens) < width:
                self.pool.truncate(r.slot, end)

    def _prefill(self, rows: Sequence[RowWork], every: bool) -> list[np.ndarray]:
        packed, order = self._pack(rows, every)
        logits, _ = self._run(packed)  # (P, W or 1, V)
        self._record_pass(packed, rows)
        in_order = _in_row_order(order, logits)
        return [in_order[i, :len(r.tokens)] if every else in_order[i]
                for i, r in enumerate(rows)]


def _in_row_order(order: np.ndarray | None, bound: np.ndarray) -> np.ndarray:
    """A pass's per-row results (n, ...) bound in slot order, in the rows' order
    (``order``: bound row j is row order[j]; None: the same)."""
    if order is None:
        return bound
    out = np.empty_like(bound)
    out[order] = bound
    return out


class _Graph:
    """A session and its IO binding, reused from pass to pass (see ``_bind``)."""

    def __init__(self, entry: GraphEntry, session: ort.InferenceSession,
                 interface: GraphInterface) -> None:
        entry.check(interface)
        self.entry = entry
        self.interface = interface
        self.session = session
        self.binding = session.io_binding()
        self.kv_bound: dict[str, tuple[int, int, int]] = {}  # group → (address, rows, length)
        self.lora_bound = -1  # adapter slots bound (adapter graphs; -1: none yet)
        self.steer_bound: np.ndarray | None = None  # the steer array bound now

    def bind_steer(self, steer: np.ndarray) -> None:
        """Bind (R, L, d) ``steer`` by address (bind_cpu_input looks for the name among
        the inputs proper, which an input with a default is not), kept alive while bound."""
        self.binding.bind_input(es.STEER, "cpu", 0, np.float32, list(steer.shape),
                                steer.ctypes.data)
        self.steer_bound = steer


@dataclass(frozen=True)
class _Rows:
    """One group of rows of a pass, bound at slots [lo, lo + n)."""

    lo: int
    ids: np.ndarray  # (n, T) right-padded
    pos: np.ndarray  # (n, T)
    seqlens: np.ndarray  # (n,) each row's total length − 1 after the pass
    total: int  # the longest row's total length
    index: np.ndarray  # (n, K) positions whose logits are wanted
    lora: np.ndarray  # (n,) each row's adapter slot (0: the base; adapter graphs)
    steering: tuple[Steering | None, ...]  # each row's control vector (None: none)


_NONE = np.zeros((1, 0), np.int64)  # (1, 0)
# The mixed graph's second group when a pass has nothing for it: one row of no tokens,
# whose attention the graph runs on a zero row over a one-position scratch cache
# (export/onnx/engine_graph.py).
_IDLE_ROW = _Rows(0, _NONE, _NONE, np.zeros(1, np.int64), 1, _NONE, np.zeros(1, np.int64),
                  (None,))
