"""model.onnx behind the ModelRunner protocol, its cache held in the same KV pool.

model.onnx is the portable graph of the ONNX I/O contract (service/contract/io_spec.py):
it takes the past as (B, nkv, T_past, hs) tensors and returns a present one step longer,
so it cannot write into the pool in place as engine.onnx does. This runner gathers each
row's cached keys and values from its pool slot into a left-padded past and writes only
the new columns back: a copy of the batch's cache per gather, the price of the portable
graph (it runs where engine.onnx does not: under CUDA, or for an artifact exported
without engine.onnx).

Under CUDA a steady batch's cache stays on the device: a decode step's presents, left in
ONNX Runtime's device memory, are bound as the next step's past, and the columns they add
reach the pool in one copy when the batch changes (``settle``), not one round trip of the
whole cache per token (measured on an H100 with SmolLM2-135M at batch 32, that round trip
made CUDA three times slower than 16 CPU cores).

The pool stays the only owner: the present of a decode step is kept only as the past of
the very next one, and only while nothing else touched the rows (same slots in the same
order, no prefill, extend, truncate, join or leave in between); otherwise the past is
gathered from the pool again. So a steady batch pays the graph's own Concat per step,
and a change of composition one gather. Under CUDA every one of those other calls first
writes the device's pending columns back (``settle``), so nothing reads a stale pool.

Left padding is what the contract specifies: ``attention_mask`` marks the real columns
and ``position_ids`` count each row's own tokens, so padding changes nothing a row
computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
import onnxruntime as ort

from service.contract import io_spec as io
from service.contract.graphs import GraphEntry
from service.engine.kv_pool import Slot
from service.engine.pooled_runner import PooledRunner
from service.engine.request import ModelVariant
from service.engine.runner import PoolConfig
from service.engine.step_plan import RowWork
from service.providers import CUDA

Shape = tuple[int, int, int, int]
Past: TypeAlias = "np.ndarray | ort.OrtValue"  # (B, nkv, T_past, hs): host or ONNX Runtime


@dataclass(frozen=True)
class _Pass:
    """A pass's rows as model.onnx's inputs (``ModelGraphRunner._pack``)."""

    index: np.ndarray  # (B,) each row's slot
    starts: np.ndarray  # (B,) tokens each row has cached: its past
    fed: np.ndarray  # (B,) tokens each row feeds
    ids: np.ndarray  # (B, T) left-padded
    mask: np.ndarray  # (B, P + T) the real columns of past and fed tokens
    pos: np.ndarray  # (B, T) each fed token's position in its own row


@dataclass
class _DeviceCarry:
    """The last decode step's presents, left on the device as the next step's past."""

    key: tuple[int, ...]  # the rows' slot indices, in order
    width: int  # T_past of the next step: the presents' length
    presents: list[ort.OrtValue]  # each (B, nkv, width, hs)
    pending: int  # the last ``pending`` columns are not in the pool yet


class ModelGraphRunner(PooledRunner):
    """ModelRunner over model.onnx: the past gathered from the pool, the new columns put back."""

    def __init__(self, session: ort.InferenceSession, config: io.ArtifactConfig,
                 pool: PoolConfig, resident: bool | None = None,
                 entry: GraphEntry | None = None) -> None:
        """``resident``: keep a steady batch's presents in ONNX Runtime between decode
        steps (default: when the session runs off the host). ``entry``: model.onnx's in
        the artifact's graph table (what /info reports); None: a plain model.onnx's."""
        n = config.n_layers
        inputs = {i.name for i in session.get_inputs()}
        outputs = {o.name for o in session.get_outputs()}
        missing = sorted(({*io.model_input_names(n)} - inputs)
                         | ({*io.model_output_names(n)} - outputs))
        if missing:
            raise ValueError(f"model.onnx does not follow the I/O contract: missing {missing}")
        super().__init__(config, pool, np.dtype(entry.kv_dtype if entry else config.kv_dtype))
        self.session = session
        self.graphs: tuple[GraphEntry, ...] = (entry or GraphEntry(io.MODEL_FILE, "fallback"),)
        self.graph_file = self.graphs[0].file
        self.provider = session.get_providers()[0]
        self.device = "cuda" if self.provider == CUDA else "cpu"
        self._past = io.past_names(n)
        self._present = io.present_names(n)
        self._buffers: dict[int, list[np.ndarray]] = {}  # two reused scratch sets, 0 and 1
        # The last decode's present, valid as the next decode's past for these slot
        # indices: (indices, scratch set, presents), or None.
        self._carry: tuple[tuple[int, ...], int, list[np.ndarray]] | None = None
        # Off the host the presents stay where ONNX Runtime wrote them (module docstring).
        self.resident = self.device != "cpu" if resident is None else resident
        self._device_carry: _DeviceCarry | None = None

    # -- scratch ---------------------------------------------------------------------

    def _scratch(self, use: int, shape: Shape) -> list[np.ndarray]:
        """One reused buffer per pool array, viewed as ``shape``: fresh arrays every step
        would cost a page fault per 4 KiB touched, more than the copy itself. Grown on
        demand; dropped when the last row leaves."""
        need = int(np.prod(shape))
        buffers = self._buffers.get(use)
        if buffers is None or buffers[0].size < need:
            size = max(need, 2 * buffers[0].size if buffers else 0)
            buffers = [np.empty(size, self.shape.dtype) for _ in self.pool.arrays]
            self._buffers[use] = buffers
        return [buffer[:need].reshape(shape) for buffer in buffers]

    def _run(self, packed: _Pass, past: list[np.ndarray], out: int
             ) -> tuple[np.ndarray, list[np.ndarray]]:
        """logits (B, T, V) and presents (B, nkv, T_past + T, hs) on the host. On CPU the
        presents are written straight into scratch set ``out`` (no copy out of ONNX
        Runtime)."""
        binding = self._bind(packed, past)
        b, t = packed.ids.shape
        shape = (b, self.shape.heads, past[0].shape[2] + t, self.shape.head_dim)
        presents: list[np.ndarray] = []
        if self.device == "cpu":
            presents = self._scratch(out, shape)  # each (B, nkv, T_past + T, hs)
            for name, buffer in zip(self._present, presents, strict=True):
                binding.bind_output(name, "cpu", 0, self.shape.dtype, list(shape),
                                    buffer.ctypes.data)
        else:
            for name in self._present:
                binding.bind_output(name, self.device)
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        if self.device != "cpu":
            presents = [v.numpy() for v in outputs[1:]]  # device → host
        return outputs[0].numpy(), presents

    def _run_resident(self, packed: _Pass, past: Sequence[Past]
                      ) -> tuple[np.ndarray, list[ort.OrtValue]]:
        """logits (B, T, V) on the host and presents (B, nkv, T_past + T, hs) left in
        ONNX Runtime's memory on the session's device."""
        binding = self._bind(packed, past)
        for name in self._present:
            binding.bind_output(name, self.device)
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        return outputs[0].numpy(), list(outputs[1:])

    def _bind(self, packed: _Pass, past: Sequence[Past]) -> ort.IOBinding:
        """A binding with the inputs set and the logits bound to the host."""
        binding = self.session.io_binding()
        binding.bind_cpu_input(io.INPUT_IDS, packed.ids)  # (B, T)
        binding.bind_cpu_input(io.ATTENTION_MASK, packed.mask)  # (B, T_past + T)
        binding.bind_cpu_input(io.POSITION_IDS, packed.pos)  # (B, T)
        for name, value in zip(self._past, past, strict=True):  # (B, nkv, T_past, hs)
            if isinstance(value, ort.OrtValue):
                binding.bind_ortvalue_input(name, value)
            else:
                binding.bind_cpu_input(name, value)
        binding.bind_output(io.LOGITS, "cpu")
        return binding

    def _gather(self, index: np.ndarray, lengths: np.ndarray, use: int) -> list[np.ndarray]:
        """Each row's cached columns, left-padded to the longest, into scratch set ``use``:
        one (B, nkv, P, hs) past per pool array."""
        b, width = len(index), int(lengths.max())
        past = self._scratch(use, (b, self.shape.heads, width, self.shape.head_dim))
        if width == 0:  # prompts into empty slots: nothing to copy
            return past
        rows = list(zip(index.tolist(), lengths.tolist(), strict=True))
        for array, p in zip(self.pool.arrays, past, strict=True):  # each (S, nkv, M, hs)
            for i, (slot, n) in enumerate(rows):
                p[i, :, :width - n] = 0  # padding: masked out, but never garbage
                p[i, :, width - n:] = array[slot, :, :n]  # (nkv, n, hs)
        return past

    # -- the protocol ----------------------------------------------------------------

    def _pack(self, rows: Sequence[RowWork]) -> _Pass:
        """The one packer: a pass's ``rows`` as model.onnx's inputs. Each row's cached
        columns end at P (the longest cache; the past is gathered left-padded to it) and
        its fed tokens at P + T (T the most a row feeds), left-padded in between, with the
        mask marking the real columns and each row's positions counting its own tokens."""
        b = len(rows)
        index = np.fromiter((r.slot.index for r in rows), np.int64, b)  # (B,)
        starts = self.pool.lengths[index]  # (B,) tokens cached, a copy
        fed = np.fromiter((len(r.tokens) for r in rows), np.int64, b)  # (B,)
        width, t = int(starts.max()), int(fed.max())
        self._check_room(int((starts + fed).max()))
        columns = np.arange(width + t)[None, :]  # (1, P + T)
        mask = (((columns >= (width - starts)[:, None]) & (columns < width))
                | (columns >= (width + t - fed)[:, None])).astype(np.int64)  # (B, P + T)
        offsets = np.arange(t)[None, :] - (t - fed)[:, None]  # (B, T): < 0 on padding
        pos = np.where(offsets >= 0, starts[:, None] + offsets, 0)  # (B, T)
        if t == 1:  # a decode step: one token a row
            ids = np.fromiter((r.tokens[0] for r in rows), np.int64, b)[:, None]  # (B, 1)
        else:
            ids = np.zeros((b, t), np.int64)  # (B, T) left-padded
            for i, r in enumerate(rows):
                ids[i, t - fed[i]:] = r.tokens
        return _Pass(index, starts, fed, ids, mask, pos)

    def _store(self, packed: _Pass, present: list[np.ndarray]) -> None:
        """The columns a pass computed, from its presents (each (B, nkv, P + T, hs)) into
        the pool, and the ids it fed with them."""
        index, starts, end = packed.index, packed.starts, packed.mask.shape[1]
        if packed.ids.shape[1] == 1:
            for array, new in zip(self.pool.arrays, present, strict=True):
                array[index, :, starts] = new[:, :, -1]  # (B, nkv, hs): the new column
        else:
            rows = list(zip(index.tolist(), starts.tolist(), packed.fed.tolist(), strict=True))
            for array, new in zip(self.pool.arrays, present, strict=True):
                for i, (slot, start, n) in enumerate(rows):
                    array[slot, :, start:start + n] = new[i, :, end - n:]  # (nkv, n, hs)
        self._record_fed(packed)

    def _record_fed(self, packed: _Pass) -> None:
        """The ids a pass fed, in the pool, and each row's length after them."""
        if packed.ids.shape[1] == 1:
            self.pool.tokens[packed.index, packed.starts] = packed.ids[:, 0]
            self.pool.lengths[packed.index] = packed.starts + 1
            return
        for i, (slot, start, n) in enumerate(zip(packed.index.tolist(), packed.starts.tolist(),
                                                 packed.fed.tolist(), strict=True)):
            self._record(slot, start, packed.ids[i, packed.ids.shape[1] - n:])

    def _decode(self, rows: Sequence[RowWork]) -> np.ndarray:
        packed = self._pack(rows)
        index, lengths = packed.index, packed.starts
        width = packed.mask.shape[1] - 1  # the past's length
        key = tuple(index.tolist())
        if self.resident:
            return self._decode_resident(packed, key)
        carry, self._carry = self._carry, None
        if carry is not None and carry[0] == key and carry[2][0].shape[2] == width:
            src, past = carry[1], carry[2]  # last step's present: the pool's rows, padded
        else:
            src, past = 0, self._gather(index, lengths, 0)
        logits, present = self._run(packed, past, out=1 - src)
        self._store(packed, present)
        if self.device == "cpu":
            self._carry = (key, 1 - src, present)
        return np.asarray(logits[:, -1])  # (B, V)

    def _decode_resident(self, packed: _Pass, key: tuple[int, ...]) -> np.ndarray:
        """``_decode`` with the cache kept on the device: the past is the last step's
        presents when the rows are the same, else gathered from the (settled) pool."""
        width = packed.mask.shape[1] - 1  # the past's length
        carry = self._device_carry
        if carry is not None and (carry.key != key or carry.width != width):
            self.settle()
            carry = None
        past: Sequence[Past] = (carry.presents if carry is not None
                                else self._gather(packed.index, packed.starts, 0))
        logits, presents = self._run_resident(packed, past)
        self._record_fed(packed)
        self._device_carry = _DeviceCarry(key, width + 1, presents,
                                          (carry.pending if carry is not None else 0) + 1)
        return np.asarray(logits[:, -1])  # (B, V)

    def settle(self) -> None:
        """Write the decode steps' columns still on the device into the pool (one copy of
        the batch's cache) and drop the carried past."""
        carry, self._device_carry = self._device_carry, None
        self._carry = None
        if carry is None or carry.pending == 0:
            return
        index = np.asarray(carry.key, np.int64)  # (B,)
        first = self.pool.lengths[index] - carry.pending  # (B,) the first pending position
        columns = carry.width - carry.pending  # where the pending columns start
        for array, value in zip(self.pool.arrays, carry.presents, strict=True):
            new = value.numpy()[:, :, columns:]  # (B, nkv, pending, hs): device → host
            for j in range(carry.pending):
                array[index, :, first + j] = new[:, :, j]  # (B, nkv, hs)

    def _prefill(self, rows: Sequence[RowWork], every: bool) -> list[np.ndarray]:
        self.settle()
        packed = self._pack(rows)
        logits, present = self._run(packed, self._gather(packed.index, packed.starts, 0), out=1)
        self._store(packed, present)
        t = packed.ids.shape[1]
        return [logits[i, t - n:] if every else logits[i, t - 1:]  # (n or 1, V)
                for i, n in enumerate(packed.fed.tolist())]

    def truncate(self, slot: Slot, length: int) -> None:
        self.settle()
        super().truncate(slot, length)

    def reserve(self, rows: int, top: bool = False,
                prompts: Sequence[np.ndarray | None] | None = None,
                variants: Sequence[ModelVariant] | None = None) -> list[Slot]:
        self.settle()
        return super().reserve(rows, top, prompts, variants)

    def leave(self, slots: Sequence[Slot], keep: Sequence[int],
              variants: Sequence[ModelVariant] | None = None) -> list[Slot]:
        self.settle()
        kept = super().leave(slots, keep, variants)
        if not self.pool.used:
            self._buffers.clear()  # idle: the scratch's memory goes back
        return kept

    def join(self, groups: Sequence[Sequence[Slot]]) -> list[Slot]:
        self.settle()
        return super().join(groups)

