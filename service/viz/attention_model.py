"""attention.onnx for the /attention dump and the /viz page: Q, K, V, scores, scaled scores
and weights of the requested layers for one sequence, and in the same pass the logit lens,
residual norms and head attribution (service/viz/look_inside.py) where the graph has them.

Kept apart from the decode runners (service/engine): it runs rarely, on its own session,
below the decode loop's priority (service/low_priority.py).

ONNX Runtime computes every node and holds every graph output of a session until a run
ends, whatever is fetched (graph_cut.py has the figures). So a request for some of the
outputs runs on a session over a copy of the graph cut down to them: one layer's maps cost
that layer's share of the work and memory, not the whole model's. Cut sessions are built
on first use (0.05 s for layer 0 of SmolLM2, about 1 s for all 30 layers' weights) and the
few most recent are kept. They all read their weights from one read-only mapping of
weights.bin made here (given to ONNX Runtime as the graph's initializers): each session
mapping the file itself would count its pages in RSS once per session. After each run the
session's arena gives its memory back, so a long input does not leave hundreds of MB held
by an idle viewer session.

Under a LoRA adapter (``run(..., adapter=name)``) the same requests run attention_lora.onnx
(service/contract/adapter_spec.py), cut the same way over the same mapping, its session
opened on the first such request: one slot (S = 1) holding that adapter's A and B, every
token's mask 1. The tensors come from the engine's AdapterSet as a copy
(``AdapterSet.weights_of``), never as views of its slot buffers, which the engine thread
rewrites in place when it evicts an adapter, between its steps, while this runs on the
attention threads; the copy is taken under the lock every slot write holds, once per
adapter (kept here by the adapter's id, which is never reused), not once per request.

Under a control vector (``run(..., steer=rows)``) the same graph runs with its ``steer``
input bound to the vector's scaled (n_layers, d) rows (service/contract/io_spec.py), the
maps and the look-inside outputs alike; attention_lora.onnx, a rewrite of attention.onnx,
takes it too where its attention.onnx did.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from service.contract import adapter_spec as spec
from service.contract import io_spec as io
from service.contract import lens_spec as lens
from service.contract import sessions
from service.contract.graphs import GraphInterface
from service.engine.adapters import AdapterSet, AdapterWeights
from service.viz.graph_cut import ExternalTensor, cut, external_tensors, graph_input_shapes
from service.viz.look_inside import LookInside

CUT_SESSIONS = 4  # cut sessions kept (a viewer's layer, its step view's, all weights, one more)
ADAPTERS_KEPT = 2  # adapters whose stacked inputs are kept (a viewer compares one at a time)
# onnx.TensorProto data types that numpy can view in place.
NUMPY_TYPES = {1: np.float32, 2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16,
               6: np.int32, 7: np.int64, 9: np.bool_, 10: np.float16, 11: np.float64,
               12: np.uint32, 13: np.uint64}


def shared_weights(source: Path, files: dict[str, np.memmap]) -> dict[str, ort.OrtValue]:
    """The external initializers of ``source`` as OrtValues over one read-only mapping per
    data file, made in ``files`` (location → mapping) unless there already: the mappings
    must outlive the values."""
    values: dict[str, ort.OrtValue] = {}
    for t in external_tensors(source.read_bytes()):
        if t.data_type not in NUMPY_TYPES or _escapes(t):
            continue  # left to ONNX Runtime's own loading
        data = files.get(t.location)
        if data is None:
            data = files[t.location] = np.memmap(source.parent / t.location, mode="r")
        array: np.ndarray = data[t.offset:t.offset + t.length].view(NUMPY_TYPES[t.data_type])
        values[t.name] = ort.OrtValue.ortvalue_from_numpy(array.reshape(t.dims))
    return values


def _escapes(t: ExternalTensor) -> bool:
    return Path(t.location).is_absolute() or ".." in Path(t.location).parts


@dataclass
class _Graph:
    """attention.onnx or attention_lora.onnx: what its requests' cut sessions are made of."""

    name: str
    source: Path | None  # the file; None: no graph to cut, ``whole`` runs every request
    data: bytes | None  # its bytes, to cut; None once it proved uncuttable (control flow)
    weights: dict[str, ort.OrtValue]
    whole: ort.InferenceSession | None = None  # the uncut graph (made when first needed)
    steers: bool = False  # whether it takes a control vector (io_spec.STEER, float32)


class AttentionModel:
    """attention.onnx: the requested layers' Q, K, V, scores, scaled scores and weights."""

    def __init__(self, session: ort.InferenceSession, config: io.ArtifactConfig,
                 source: Path | None = None, adapters: AdapterSet | None = None) -> None:
        """``source``: the session's attention.onnx, to cut per request; without it every
        request runs the whole graph. ``adapters``: the engine's, for requests under an
        adapter (they need attention_lora.onnx beside ``source``)."""
        self.session = session
        self.config = config
        self._outputs = io.attention_output_names(config.n_layers)
        available = {o.name for o in session.get_outputs()}
        missing = sorted(set(self._outputs) - available)
        if missing:
            raise ValueError(f"attention.onnx lacks outputs {missing[:4]}...")
        self._looks_inside = set(lens.inspect_output_names(config.n_layers)) <= available
        self._files: dict[str, np.memmap] = {}
        steers = GraphInterface.of_session(session).steers  # as the engine graphs' steer
        self._base = _Graph(io.ATTENTION_FILE, source,
                            source.read_bytes() if source is not None else None,
                            shared_weights(source, self._files) if source is not None else {},
                            session, steers)
        lora = source.parent / spec.lora_file(source.name) if source is not None else None
        self._lora_source = lora if lora is not None and lora.is_file() else None
        self._lora: _Graph | None = None  # opened on the first request under an adapter
        self.adapters = adapters
        self._adapter_inputs: OrderedDict[int, dict[str, np.ndarray]] = OrderedDict()
        self._cut: OrderedDict[tuple[str, frozenset[str]], ort.InferenceSession] = OrderedDict()
        self._lock = threading.Lock()
        self._run_options = ort.RunOptions()
        if session.get_providers()[0] == sessions.CPU:
            self._run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage",
                                                   "cpu:0")
        self.sessions_built = 0  # cut sessions built since start (a stat for tests)

    @property
    def applies_adapters(self) -> bool:
        """Whether ``run`` takes an ``adapter``: the engine serves adapters and the artifact
        has attention_lora.onnx."""
        return self.adapters is not None and self._lora_source is not None

    @property
    def steers(self) -> bool:
        """Whether attention.onnx takes a control vector (``steer``): artifacts exported
        before it do not."""
        return self._base.steers

    def steers_under_adapters(self) -> bool:
        """Whether attention_lora.onnx takes a control vector too (opens that graph; needs
        :attr:`applies_adapters`)."""
        return self._lora_graph().steers

    @property
    def looks_inside(self) -> bool:
        """Whether attention.onnx has the logit lens, residual norms and attribution
        (service/contract/lens_spec.py): artifacts exported before them do not."""
        return self._looks_inside

    def run(self, token_ids: Sequence[int], kinds: Sequence[str],
            layers: Sequence[int] | None = None, adapter: str | None = None,
            steer: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """{kind: (len(layers), heads, T, T or hs)} for one sequence, in the layout bertviz
        uses; ``layers`` in the order given (default: every layer); under the LoRA adapter
        served as ``adapter`` when one is named (UnknownAdapter if it is not served);
        steered by ``steer`` (n_layers, d), a control vector's scaled rows, when given
        (needs :attr:`steers`, or :meth:`steers_under_adapters` with an adapter)."""
        return self.look(token_ids, kinds, layers, adapter, steer=steer)[0]

    def look(self, token_ids: Sequence[int], kinds: Sequence[str],
             layers: Sequence[int] | None = None, adapter: str | None = None,
             inside: LookInside | None = None, steer: np.ndarray | None = None
             ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """As :meth:`run`, and in the same pass what ``inside`` asks (LookInside.collect's
        arrays; empty without it). Needs :attr:`looks_inside` for ``inside``."""
        layers = list(range(self.config.n_layers)) if layers is None else list(layers)
        ids = np.asarray([token_ids], dtype=np.int64)  # (1, T)
        feeds = {io.INPUT_IDS: ids, io.ATTENTION_MASK: np.ones_like(ids),
                 io.POSITION_IDS: np.arange(ids.shape[1], dtype=np.int64)[None, :]}
        graph = self._base
        if adapter is not None:
            graph = self._lora_graph()
            inputs = self._inputs_of(adapter)
            rows = len(next(iter(inputs.values())))
            feeds |= inputs
            feeds[spec.LORA_MASK] = np.ones((ids.shape[1], rows), np.float32)  # (T, R)
        if steer is not None:
            if not graph.steers:
                raise ValueError(f"{graph.name} takes no control vector (no {io.STEER} input)")
            feeds[io.STEER] = np.asarray(steer, np.float32)  # (n_layers, d)
        names = [io.attention_output_name(i, k) for k in kinds for i in layers]
        extra = inside.outputs(layers) if inside is not None else []
        if inside is not None:
            feeds |= inside.feeds()
        values = self._session(graph, names + extra).run(names + extra, feeds,
                                                         self._run_options)
        n = len(layers)  # each value (1, nh, T, T or hs)
        maps = {k: np.concatenate(values[j * n:(j + 1) * n], axis=0)  # (n, nh, T, ...)
                for j, k in enumerate(kinds)}
        if inside is None:
            return maps, {}
        fetched = dict(zip(extra, values[len(names):], strict=True))
        return maps, inside.collect(fetched, layers, self.config.n_layers,
                                    self.config.n_heads)

    def _lora_graph(self) -> _Graph:
        if self._lora_source is None or self.adapters is None:
            raise RuntimeError("no adapter graph (attention_lora.onnx) or no adapters served")
        with self._lock:
            if self._lora is None:
                data = self._lora_source.read_bytes()
                self._lora = _Graph(self._lora_source.name, self._lora_source, data,
                                    shared_weights(self._lora_source, self._files),
                                    steers=io.STEER in graph_input_shapes(data))
            return self._lora

    def _inputs_of(self, name: str) -> dict[str, np.ndarray]:
        """Every lora.<module>.A and .B input for adapter ``name`` in one slot: (R, in) and
        (R, out), zeros for a module it does not adapt; kept per adapter id."""
        assert self.adapters is not None
        ref = self.adapters.ref_of(name)
        with self._lock:
            held = self._adapter_inputs.get(ref.id)
            if held is not None:
                self._adapter_inputs.move_to_end(ref.id)
                return held
        inputs = _stacked(self.adapters.weights_of(ref), self.adapters.slots.widths)
        with self._lock:
            self._adapter_inputs[ref.id] = inputs
            while len(self._adapter_inputs) > ADAPTERS_KEPT:
                self._adapter_inputs.popitem(last=False)
        return inputs

    def _session(self, graph: _Graph, names: Sequence[str]) -> ort.InferenceSession:
        """A session whose graph computes ``names`` and nothing past them."""
        key = (graph.name, frozenset(names))
        with self._lock:  # several attention threads may ask at once
            if graph.data is None:
                return self._whole(graph)
            session = self._cut.get(key)
            if session is None:
                assert graph.source is not None
                try:
                    data = cut(graph.data, sorted(key[1]))
                except ValueError:  # control flow: not cut, the whole graph runs
                    graph.data = None
                    return self._whole(graph)
                session = self._open(data, graph)
                self.sessions_built += 1
                self._cut[key] = session
                while len(self._cut) > CUT_SESSIONS:
                    self._cut.popitem(last=False)
            self._cut.move_to_end(key)
            return session

    def _whole(self, graph: _Graph) -> ort.InferenceSession:
        if graph.whole is None:
            assert graph.source is not None
            graph.whole = self._open(graph.source.read_bytes(), graph)
        return graph.whole

    def _open(self, data: bytes, graph: _Graph) -> ort.InferenceSession:
        assert graph.source is not None
        options = self.session.get_session_options()
        return sessions.create_session(
            data, threads=options.intra_op_num_threads, providers=self.session.get_providers(),
            prepack=False, external_data_dir=graph.source.parent, initializers=graph.weights)


def _stacked(weights: AdapterWeights, widths: dict[str, tuple[int, int]]
             ) -> dict[str, np.ndarray]:
    """One slot of the adapter graph's inputs: each module's A and B, R = ``weights.rank``
    rows, an adapter's rank r < R (or a module it does not adapt) padded with zero rows."""
    rank = weights.rank
    inputs: dict[str, np.ndarray] = {}
    for module, (width_in, width_out) in widths.items():
        a = np.zeros((rank, width_in), np.float32)  # (R, in)
        b = np.zeros((rank, width_out), np.float32)  # (R, out)
        pair = weights.modules.get(module)
        if pair is not None:
            a[:len(pair[0])] = pair[0]
            b[:len(pair[1])] = pair[1]
        inputs[spec.lora_a(module)] = a
        inputs[spec.lora_b(module)] = b
    return inputs
