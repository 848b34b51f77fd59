"""The control vectors a server serves, by name: each row's steering, as the graph takes it.

A vector is llama.cpp's control-vector file (service/contract/control_vector.py), held as
one (n_layers, d) float32 table: row ``k`` is the direction added after block ``k``, row 0
and any layer the file has no direction for zeros (llama.cpp never steers the first
block's output). A request names a vector, a scale and optionally a layer range
(request.ControlChoice); :meth:`ControlVectors.resolve` turns it into the row's
``Steering`` (the vector's id: a vector loaded again under its name is another, so the
prefix cache never mixes them), and :meth:`ControlVectors.table` into the (n_layers, d)
rows the engine graph's ``steer`` input takes: the directions times the scale in float32,
as llama.cpp multiplies them when it reads the file, zero outside the range.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from service.contract.control_vector import ControlVectorError, read_control_vector
from service.engine.request import ControlChoice, Steering
from service.settings import named_paths

_KEPT_TABLES = 256  # scaled tables kept for reuse across steps


class UnknownControlVector(LookupError):
    """A request names a control vector the server does not serve (404)."""


class ControlVectors:
    """The served vectors of a model of ``n_layers`` blocks ``d_model`` wide. Thread-safe:
    requests resolve names on the event loop, the engine reads tables on its thread."""

    def __init__(self, n_layers: int, d_model: int) -> None:
        self.n_layers, self.d_model = n_layers, d_model
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._named: dict[str, int] = {}  # name → id
        self._tables: dict[int, np.ndarray] = {}  # id → (n_layers, d) directions
        self._scaled: dict[Steering, np.ndarray] = {}  # the steer rows each steering made

    def read(self, path: str | os.PathLike[str]) -> np.ndarray:
        """A file's directions as a (n_layers, d) table; ControlVectorError (one line) for a
        file llama.cpp would refuse, or whose width or layers do not fit the model."""
        vector = read_control_vector(path, self.d_model, self.n_layers)
        table = np.zeros((self.n_layers, self.d_model), np.float32)  # (L, d)
        for layer, direction in vector.directions.items():
            table[layer] = direction
        return table

    def add(self, name: str, table: np.ndarray) -> int:
        """Serve ``table`` (from :meth:`read`) as ``name``, replacing one of that name: its id."""
        if table.shape != (self.n_layers, self.d_model):
            raise ControlVectorError(f"control vector {name}: a table of {table.shape}, the "
                                     f"model takes ({self.n_layers}, {self.d_model})")
        with self._lock:
            vector_id = next(self._ids)
            self._named[name] = vector_id
            self._tables[vector_id] = table
            return vector_id

    def remove(self, name: str) -> None:
        """Stop serving ``name``; rows already running under it keep their directions
        (``Steering.directions``)."""
        with self._lock:
            vector_id = self._named.pop(name, None)
            if vector_id is None:
                raise UnknownControlVector(name)
            del self._tables[vector_id]

    @property
    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._named)

    def layers_of(self, name: str) -> list[int]:
        """The layers ``name`` has a direction for."""
        with self._lock:
            table = self._tables[self._named[name]]
        return [k for k in range(1, self.n_layers) if table[k].any()]

    def resolve(self, choice: ControlChoice) -> Steering:
        """The steering a request runs under; UnknownControlVector for a name not served."""
        with self._lock:
            vector_id = self._named.get(choice.name)
            if vector_id is None:
                raise UnknownControlVector(choice.name)
            return Steering(choice.name, vector_id, choice.scale, choice.layers,
                            self._tables[vector_id])

    def table(self, steering: Steering) -> np.ndarray:
        """The (n_layers, d) rows a row under ``steering`` adds after each block: the
        directions times the scale (float32), zero outside its layers (computed once)."""
        made = self._scaled.get(steering)
        if made is not None:
            return made
        # (L, d): as llama.cpp scales them when it reads the file
        scaled = steering.directions * np.float32(steering.scale)
        if steering.layers is not None:
            start, end = steering.layers
            outside = [k for k in range(self.n_layers) if not start <= k <= end]
            scaled[outside] = 0.0
        if len(self._scaled) >= _KEPT_TABLES:  # requests choose scales freely: bounded
            self._scaled.clear()
        self._scaled[steering] = scaled
        return scaled


def confined_file(path: Path, root: Path) -> Path:
    """``path`` with every symlink resolved, if it is a file under ``root`` (resolved too);
    ControlVectorError otherwise: a run-time load reads nothing outside that directory."""
    try:
        resolved = path.resolve(strict=True)
    except (OSError, RuntimeError) as exc:
        raise ControlVectorError(f"{path} does not exist") from exc
    if not resolved.is_file():
        raise ControlVectorError(f"{path} is not a file")
    if not resolved.is_relative_to(root.resolve()):
        raise ControlVectorError(f"{path} leads outside the control-vector directory "
                                 "(--control-vector-dir); only files under it may be loaded")
    return resolved


def control_entries(entries: Sequence[str]) -> list[tuple[str, Path]]:
    """``--control-vectors``' NAME=FILE entries as (name, file) (``named_paths``)."""
    return named_paths(entries, "--control-vectors", "FILE")
