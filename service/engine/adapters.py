"""LoRA adapters served over one base: read, held in the adapter graph's slots, chosen per row.

An adapter graph (service/contract/adapter_spec.py) takes, for every module a LoRA adapter
may adapt, the A and B of S resident adapters stacked slot by slot, R rows each (an
adapter of rank r < R fills r of them, the rest stay zero), and a mask that sends each
token to its row's slot; a base row's tokens reach none. So rows of different adapters,
and base rows, share one pass and every read of the base weights (Punica's and S-LoRA's
gathered LoRA, written as one masked product per module, which a CPU runs as two GEMMs).

Three parts, each with one owner:

- :func:`read_adapter_weights` reads a PEFT adapter directory into numpy, checked against
  the modules and widths the graph takes and the server's rank per slot, B already scaled
  (alpha / r, or alpha / √r under rsLoRA, per module as PEFT's rank and alpha patterns say).
- :class:`AdapterSlots`: the stacked buffers the runner binds (bound once: a slot is
  rewritten in place, between steps, by the engine thread alone).
- :class:`AdapterSet`: which adapters the server knows by name, which sit in a slot (at
  most ``--max-loras``, least recently used evicted when another is needed and no running
  row uses it), and how many requests each has in flight (an unload waits for them).

An adapter is known by an ``id`` that is never reused: the prefix cache keys blocks by it
(a prefix computed under one adapter never serves another, nor the base), and an adapter
unloaded and loaded again under the same name is a new one.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from service.contract import adapter_spec as spec
from service.contract.peft_adapter import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterError,
    read_config,
    tensor_pairs,
    weights_path,
)
from service.engine.request import AdapterRef
from service.settings import default_of, named_paths

BASE = 0  # the id (and slot) of no adapter


class UnknownAdapter(LookupError):
    """A request names an adapter the server does not serve (OpenAI's and vLLM's 404)."""


@dataclass(frozen=True)
class AdapterWeights:
    """One adapter's tensors as the graph takes them: per module A (r, in) and s·Bᵀ (r, out)."""

    name: str
    path: Path
    rank: int  # the widest module's r
    modules: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def read_adapter_weights(directory: Path, name: str, widths: Mapping[str, tuple[int, int]],
                         max_rank: int) -> AdapterWeights:
    """The PEFT adapter in ``directory`` for a graph whose modules have ``widths`` (module →
    (in, out)); AdapterError with one line naming what does not fit."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    config = read_config(directory)
    path = weights_path(directory)
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise AdapterError(f"{path} is not a readable safetensors file: {exc}") from exc
    modules: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for module, (a, b) in tensor_pairs(path, tensors, widths, "the served model").items():
        # a (r, in), b (out, r)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{path}: {module} has A {list(a.shape)} and B "
                               f"{list(b.shape)}, not (r, in) and (out, r)")
        if (a.shape[1], b.shape[0]) != tuple(widths[module]):
            raise AdapterError(
                f"{path}: {module} maps {a.shape[1]} → {b.shape[0]} features; the served "
                f"model's maps {widths[module][0]} → {widths[module][1]} (an adapter for "
                "another base model?)")
        rank = int(a.shape[0])
        if rank > max_rank:
            raise AdapterError(f"{path}: {module} has rank {rank}, above --max-lora-rank "
                               f"{max_rank}")
        scale = np.float32(config.scale(module, rank))
        modules[module] = (np.ascontiguousarray(a, np.float32),  # (r, in)
                           np.ascontiguousarray(b.T.astype(np.float32) * scale))  # (r, out)
    return AdapterWeights(name, directory, max(a.shape[0] for a, _ in modules.values()),
                          modules)


@dataclass(frozen=True, kw_only=True)
class AdapterLimits:
    """The adapter graph's slots: the settings of these names (service/settings.py), which
    the engine passes by name (``of_settings``)."""

    max_loras: int = default_of("max_loras")  # S: adapters resident at once
    max_lora_rank: int = default_of("max_lora_rank")  # R: the largest rank a slot holds


class AdapterSlots:
    """The adapter graph's stacked inputs: per module A (S·R, in) and B (S·R, out), slot s
    (1-based) in rows [(s − 1)·R, s·R). Written only between passes (the engine thread)."""

    def __init__(self, widths: Mapping[str, tuple[int, int]], limits: AdapterLimits) -> None:
        if limits.max_loras < 1 or limits.max_lora_rank < 1:
            raise ValueError("an adapter graph needs at least one slot of rank ≥ 1")
        self.widths = dict(widths)
        self.limits = limits
        self.rank = limits.max_lora_rank  # R: rows of each slot
        rows = limits.max_loras * self.rank
        self.buffers: dict[str, np.ndarray] = {}  # input name → (S·R, in or out) float32
        for module, (width_in, width_out) in self.widths.items():
            self.buffers[spec.lora_a(module)] = np.zeros((rows, width_in), np.float32)
            self.buffers[spec.lora_b(module)] = np.zeros((rows, width_out), np.float32)
        self._columns = np.arange(rows) // self.rank + 1  # (S·R,) the slot of each column

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    def write(self, slot: int, weights: AdapterWeights) -> None:
        """Put ``weights`` in ``slot``, every module's rows (zeros where it adapts none)."""
        rows = slice((slot - 1) * self.rank, slot * self.rank)
        for module in self.widths:
            a_rows = self.buffers[spec.lora_a(module)][rows]  # (R, in)
            b_rows = self.buffers[spec.lora_b(module)][rows]  # (R, out)
            a_rows[:] = 0.0
            b_rows[:] = 0.0
            pair = weights.modules.get(module)
            if pair is not None:
                a, b = pair
                a_rows[:len(a)] = a
                b_rows[:len(b)] = b

    def mask(self, token_slots: np.ndarray, used: int) -> np.ndarray:
        """(N, used·R) float32: 1 where a token's slot owns the column (``token_slots``
        (N,): each fed token's row's slot, padding included; 0 for a base token)."""
        columns = self._columns[:used * self.rank]  # (used·R,)
        return (np.asarray(token_slots)[:, None] == columns[None, :]).astype(np.float32)

    def views(self, used: int) -> dict[str, np.ndarray]:
        """Each input's first ``used`` slots: contiguous prefixes of the buffers."""
        rows = used * self.rank
        return {name: buffer[:rows] for name, buffer in self.buffers.items()}


@dataclass
class _Entry:
    ref: AdapterRef
    path: Path
    weights: AdapterWeights | None  # held until first placed in a slot, then read again
    nbytes: int
    in_flight: int = 0  # requests submitted and not yet finished
    running: int = 0  # of those, admitted to the batch (their rows use the slot)
    unloading: bool = False
    counts: dict[str, int] = field(default_factory=lambda: {"loads": 0, "evictions": 0})


class AdapterSet:
    """The adapters a server knows, by name, and which of them sit in a slot.

    Thread-safe: requests resolve names from the HTTP threads, the engine thread places
    adapters in slots when it admits their requests, an unload waits on another thread.
    """

    def __init__(self, slots: AdapterSlots) -> None:
        self.slots = slots
        self._lock = threading.Condition()
        self._named: dict[str, _Entry] = {}
        self._by_id: dict[int, _Entry] = {}
        self._resident: OrderedDict[int, int] = OrderedDict()  # id → slot, least recent first
        self._ids = itertools.count(1)
        self.evictions = 0

    # -- names (any thread) ----------------------------------------------------------

    def read(self, directory: Path, name: str) -> AdapterWeights:
        """Read and check an adapter for these slots (no state changes: a failed read
        leaves everything as it was)."""
        return read_adapter_weights(directory, name, self.slots.widths, self.slots.rank)

    def add(self, weights: AdapterWeights) -> AdapterRef:
        """Serve ``weights`` under its name (placed in a slot when a request first needs
        it); ValueError if the name is taken."""
        with self._lock:
            if weights.name in self._named:
                raise ValueError(f"an adapter named {weights.name!r} is already loaded")
            entry = _Entry(AdapterRef(weights.name, next(self._ids)), weights.path, weights,
                           weights.nbytes)
            self._named[weights.name] = self._by_id[entry.ref.id] = entry
            return entry.ref

    def names(self) -> list[str]:
        with self._lock:
            return [n for n, e in self._named.items() if not e.unloading]

    def begin(self, name: str) -> AdapterRef:
        """A request for adapter ``name`` starts: counted until :meth:`end`."""
        with self._lock:
            entry = self._named.get(name)
            if entry is None or entry.unloading:
                raise UnknownAdapter(name)
            entry.in_flight += 1
            return entry.ref

    def end(self, ref: AdapterRef) -> None:
        with self._lock:
            entry = self._by_id.get(ref.id)
            if entry is not None:
                entry.in_flight -= 1
                if entry.unloading and entry.in_flight == 0:
                    self._drop(entry)
                self._lock.notify_all()

    def remove(self, name: str, timeout: float | None = None) -> bool:
        """Stop serving ``name``: new requests for it are refused at once, then wait for
        those in flight to finish (False if ``timeout`` passed first: it stays refused and
        leaves when they are done) and free its slot. UnknownAdapter if it is not served."""
        with self._lock:
            entry = self._named.get(name)
            if entry is None or entry.unloading:
                raise UnknownAdapter(name)
            entry.unloading = True
            if entry.in_flight == 0:
                self._drop(entry)
            return self._lock.wait_for(lambda: entry.ref.id not in self._by_id, timeout)

    def _drop(self, entry: _Entry) -> None:
        del self._named[entry.ref.name]
        del self._by_id[entry.ref.id]
        self._resident.pop(entry.ref.id, None)

    def ref_of(self, name: str) -> AdapterRef:
        """The served adapter ``name`` (not counted in flight: for a reader that copies its
        weights, :meth:`weights_of`); UnknownAdapter if it is not served."""
        with self._lock:
            entry = self._named.get(name)
            if entry is None or entry.unloading:
                raise UnknownAdapter(name)
            return entry.ref

    def weights_of(self, ref: AdapterRef) -> AdapterWeights:
        """``ref``'s tensors for a reader on another thread (the attention dump), never a
        view of a slot: the engine thread rewrites a slot in place when it evicts its
        adapter, so a resident adapter's R rows per module are copied out here, under the
        lock every slot write holds. Not yet placed: the tensors read at load (never
        written); evicted: read again from its directory, outside the lock."""
        with self._lock:
            entry = self._by_id.get(ref.id)
            if entry is None or entry.unloading:
                raise UnknownAdapter(ref.name)
            if entry.weights is not None:
                return entry.weights
            slot = self._resident.get(ref.id)
            if slot is not None:
                rows = slice((slot - 1) * self.slots.rank, slot * self.slots.rank)
                buffers = self.slots.buffers
                modules = {m: (buffers[spec.lora_a(m)][rows].copy(),  # (R, in)
                               buffers[spec.lora_b(m)][rows].copy())  # (R, out)
                           for m in self.slots.widths}
                return AdapterWeights(ref.name, entry.path, self.slots.rank, modules)
            path = entry.path
        return self.read(path, ref.name)

    def counts(self) -> dict[str, dict[str, int]]:
        """Per served adapter: times placed in a slot and evicted from one."""
        with self._lock:
            return {n: dict(e.counts) for n, e in self._named.items()}

    def resident(self) -> dict[str, int]:
        """Served adapters in a slot: name → slot."""
        with self._lock:
            return {self._by_id[i].ref.name: s for i, s in self._resident.items()}

    def activity(self) -> tuple[list[str], list[str]]:
        """(names with requests running, names with requests waiting): running, admitted to
        the batch (their adapter in a slot); waiting, submitted and not yet admitted, e.g.
        for a slot (vLLM's ``running_lora_adapters`` / ``waiting_lora_adapters``)."""
        with self._lock:
            entries = list(self._by_id.values())
            return ([e.ref.name for e in entries if e.running > 0],
                    [e.ref.name for e in entries if e.in_flight > e.running])

    def resident_bytes(self) -> int:
        """What the resident adapters' own tensors take (their share of the slots)."""
        with self._lock:
            return sum(self._by_id[i].nbytes for i in self._resident)

    # -- slots (the engine thread) ---------------------------------------------------

    def acquire(self, ref: AdapterRef) -> bool:
        """Make ``ref`` resident for one more running request: placed in a free slot, or
        in that of the least recently used adapter no running row uses; False when every
        slot is in use (the request waits). AdapterError if its files, read again after an
        eviction, no longer hold a valid adapter."""
        with self._lock:
            entry = self._by_id.get(ref.id)
            if entry is None:
                raise UnknownAdapter(ref.name)
            if ref.id not in self._resident:
                slot = self._free_slot()
                if slot is None:
                    return False
                weights = entry.weights or self.read(entry.path, entry.ref.name)
                self.slots.write(slot, weights)
                entry.weights = None  # the slot holds it now
                entry.counts["loads"] += 1
                self._resident[ref.id] = slot
            self._resident.move_to_end(ref.id)
            entry.running += 1
            return True

    def release(self, ref: AdapterRef) -> None:
        with self._lock:
            entry = self._by_id.get(ref.id)
            if entry is not None:
                entry.running -= 1

    def slot_of(self, adapter_id: int) -> int:
        """The slot a running row's adapter sits in (0: the base)."""
        return 0 if adapter_id == BASE else self._resident[adapter_id]

    def _free_slot(self) -> int | None:
        taken = set(self._resident.values())
        free = next((s for s in range(1, self.slots.limits.max_loras + 1) if s not in taken), None)
        if free is not None:
            return free
        idle = next((i for i in self._resident if self._by_id[i].running == 0), None)
        if idle is None:
            return None
        slot = self._resident.pop(idle)
        self._by_id[idle].counts["evictions"] += 1
        self.evictions += 1
        return slot


def adapter_widths(input_shapes: Mapping[str, Sequence[Any]]) -> dict[str, tuple[int, int]]:
    """Module → (in, out) of every module an adapter graph takes, from its inputs' shapes
    (input name → dims; empty for a graph without adapters)."""
    return {m: (int(input_shapes[spec.lora_a(m)][1]), int(input_shapes[spec.lora_b(m)][1]))
            for m in spec.adapter_modules(list(input_shapes))}


def lora_entries(entries: Sequence[str]) -> list[tuple[str, Path]]:
    """``--lora-modules``' NAME=DIR entries as (name, directory) (``named_paths``)."""
    return named_paths(entries, "--lora-modules", "DIR")


def confined(directory: Path, root: Path) -> Path:
    """``directory`` with every symlink resolved, if it lies under ``root`` (resolved too);
    AdapterError otherwise: a runtime load reads nothing outside the adapter directory."""
    try:
        resolved = directory.resolve(strict=True)
    except (OSError, RuntimeError) as exc:
        raise AdapterError(f"adapter directory {directory} does not exist") from exc
    root = root.resolve()
    inside = [resolved, *(f.resolve() for f in (resolved / CONFIG_FILE,
                                                resolved / WEIGHTS_FILE) if f.exists())]
    if not all(p.is_relative_to(root) for p in inside):
        raise AdapterError(f"{directory} leads outside the adapter directory (--lora-dir); "
                           "only adapters under it may be loaded")
    return resolved
