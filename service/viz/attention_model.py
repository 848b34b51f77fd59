"""attention.onnx for the /attention dump and the /viz page: Q, K, V, scores, scaled scores
and weights of the requested layers for one sequence.

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
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from service.contract import io_spec as io
from service.contract import sessions
from service.viz.graph_cut import ExternalTensor, cut, external_tensors

CUT_SESSIONS = 4  # cut sessions kept (a viewer's layer, its step view's, all weights, one more)
# onnx.TensorProto data types that numpy can view in place.
NUMPY_TYPES = {1: np.float32, 2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16,
               6: np.int32, 7: np.int64, 9: np.bool_, 10: np.float16, 11: np.float64,
               12: np.uint32, 13: np.uint64}


def shared_weights(source: Path) -> tuple[list[np.memmap], dict[str, ort.OrtValue]]:
    """The external initializers of ``source`` as OrtValues over one read-only mapping per
    data file (the mappings are returned too: they must outlive the values)."""
    files: dict[str, np.memmap] = {}
    values: dict[str, ort.OrtValue] = {}
    for t in external_tensors(source.read_bytes()):
        if t.data_type not in NUMPY_TYPES or _escapes(t):
            continue  # left to ONNX Runtime's own loading
        data = files.get(t.location)
        if data is None:
            data = files[t.location] = np.memmap(source.parent / t.location, mode="r")
        array: np.ndarray = data[t.offset:t.offset + t.length].view(NUMPY_TYPES[t.data_type])
        values[t.name] = ort.OrtValue.ortvalue_from_numpy(array.reshape(t.dims))
    return list(files.values()), values


def _escapes(t: ExternalTensor) -> bool:
    return Path(t.location).is_absolute() or ".." in Path(t.location).parts


class AttentionModel:
    """attention.onnx: the requested layers' Q, K, V, scores, scaled scores and weights."""

    def __init__(self, session: ort.InferenceSession, config: io.ArtifactConfig,
                 source: Path | None = None) -> None:
        """``source``: the session's attention.onnx, to cut per request; without it every
        request runs the whole graph."""
        self.session = session
        self.config = config
        self._outputs = io.attention_output_names(config.n_layers)
        available = {o.name for o in session.get_outputs()}
        missing = sorted(set(self._outputs) - available)
        if missing:
            raise ValueError(f"attention.onnx lacks outputs {missing[:4]}...")
        self._source = source
        self._graph = source.read_bytes() if source is not None else None
        self._files, self._weights = shared_weights(source) if source is not None else ([], {})
        self._cut: OrderedDict[frozenset[str], ort.InferenceSession] = OrderedDict()
        self._lock = threading.Lock()
        self._run_options = ort.RunOptions()
        if session.get_providers()[0] == sessions.CPU:
            self._run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage",
                                                   "cpu:0")
        self.sessions_built = 0  # cut sessions built since start (a stat for tests)

    def run(self, token_ids: Sequence[int], kinds: Sequence[str],
            layers: Sequence[int] | None = None) -> dict[str, np.ndarray]:
        """{kind: (len(layers), heads, T, T or hs)} for one sequence, in the layout bertviz
        uses; ``layers`` in the order given (default: every layer)."""
        layers = list(range(self.config.n_layers)) if layers is None else list(layers)
        ids = np.asarray([token_ids], dtype=np.int64)  # (1, T)
        feeds = {io.INPUT_IDS: ids, io.ATTENTION_MASK: np.ones_like(ids),
                 io.POSITION_IDS: np.arange(ids.shape[1], dtype=np.int64)[None, :]}
        names = [io.attention_output_name(i, k) for k in kinds for i in layers]
        values = self._session(names).run(names, feeds, self._run_options)
        n = len(layers)  # each value (1, nh, T, T or hs)
        return {k: np.concatenate(values[j * n:(j + 1) * n], axis=0)  # (n, nh, T, ...)
                for j, k in enumerate(kinds)}

    def _session(self, names: Sequence[str]) -> ort.InferenceSession:
        """A session whose graph computes ``names`` and nothing past them."""
        key = frozenset(names)
        if self._graph is None:
            return self.session
        with self._lock:  # several attention threads may ask at once
            session = self._cut.get(key)
            if session is None:
                assert self._source is not None
                try:
                    graph = cut(self._graph, sorted(key))
                except ValueError:  # control flow: not cut, the whole graph runs
                    self._graph = None
                    return self.session
                options = self.session.get_session_options()
                session = sessions.create_session(
                    graph, threads=options.intra_op_num_threads,
                    providers=self.session.get_providers(), prepack=False,
                    external_data_dir=self._source.parent, initializers=self._weights)
                self.sessions_built += 1
                self._cut[key] = session
                while len(self._cut) > CUT_SESSIONS:
                    self._cut.popitem(last=False)
            self._cut.move_to_end(key)
            return session
