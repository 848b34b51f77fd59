"""engine.onnx behind the batch's ModelRunner: a static KV cache written in place.

model.onnx returns a new, one-column-longer present for every layer at every step
(Concat of past and new). engine.onnx instead takes one preallocated buffer per layer,
(B, nh, max_seq_len, hs), bound through IO binding as both past and present, and its
GroupQueryAttention writes the new keys and values into it in place.

The batch keeps its left-padded bookkeeping (attention_mask, position_ids); this runner
translates at the boundary. In the buffers each row's tokens start at column 0 and
``lengths`` says how many are cached, which is what the kernel reads (``seqlens_k``).
A prefill turns the left-padded prompts into right-padded ones and the logits back.
When the batch changes composition it asks for the cache as left-padded arrays
(``kv_to_numpy``) and hands them back (``kv_from_numpy``); the buffers are rebuilt from
those arrays at the next forward pass, where the attention mask says which columns are
real. Steps in between copy nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime as ort

from service.contract import engine_spec as es
from service.contract import io_spec as io


@dataclass
class StaticKV:
    """One batch's cache: per-layer buffers (B, nh, M, hs) and each row's cached length."""

    buffers: list[Any]  # 2 * n_layers OrtValues, each (B, nh, M, hs)
    lengths: np.ndarray  # (B,) int64: tokens cached per row, from column 0
    width: int  # the batch's attention_mask width after the last forward


@dataclass
class PendingKV:
    """Left-padded arrays from kv_from_numpy, turned into buffers at the next forward."""

    arrays: list[np.ndarray]  # 2 * n_layers (B, nh, L, hs), left-padded like the mask


class StaticCacheModel:
    """ModelRunner over engine.onnx (float32 cache on CPU)."""

    def __init__(self, session: ort.InferenceSession, config: io.ArtifactConfig,
                 max_len: int | None = None) -> None:
        """``max_len``: positions per slot, the longest sequence the service admits
        (max_total_tokens); the model's whole context (imported models: 8k-32k) otherwise."""
        self.session = session
        self.config = config
        self.vocab_size = config.vocab_size
        self.graph_file = es.ENGINE_FILE
        self.provider = session.get_providers()[0]
        self.device = "cpu"
        self.max_len = min(max_len or config.max_seq_len, config.max_seq_len)
        n = config.n_layers
        self._past, self._present = io.past_names(n), io.present_names(n)
        inputs = {i.name for i in session.get_inputs()}
        outputs = {o.name for o in session.get_outputs()}
        missing = sorted(({*es.engine_input_names(n)} - inputs)
                         | ({*es.engine_output_names(n)} - outputs))
        if missing:
            raise ValueError(f"{es.ENGINE_FILE} lacks {missing}")

    def _new_buffers(self, batch: int) -> list[Any]:
        shape = (batch, self.config.kv_heads, self.max_len, self.config.head_dim)
        return [ort.OrtValue.ortvalue_from_shape_and_type(shape, np.float32)
                for _ in self._past]  # contents past each row's length are never read

    def _materialize(self, pending: PendingKV, past_mask: np.ndarray) -> StaticKV:
        lengths = past_mask.sum(axis=1).astype(np.int64)  # (B,)
        buffers = self._new_buffers(past_mask.shape[0])
        real = past_mask.astype(bool)  # (B, L)
        for buf, arr in zip(buffers, pending.arrays, strict=True):
            dst = buf.numpy()  # a view on the OrtValue's memory
            for row in range(arr.shape[0]):
                dst[row, :, :lengths[row]] = arr[row][:, real[row]]  # (nh, len, hs)
            self._write_back(buf, dst)
        return StaticKV(buffers, lengths, past_mask.shape[1])

    @staticmethod
    def _write_back(buf: Any, array: np.ndarray) -> None:
        if buf.data_ptr() != array.__array_interface__["data"][0]:
            buf.update_inplace(array)  # numpy() gave a copy on this build

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray,
                position_ids: np.ndarray, past: Sequence[Any] | StaticKV | PendingKV | None,
                all_logits: bool) -> tuple[np.ndarray, Any]:
        """Logits as the batch expects them, and the cache: a StaticKV (the batch's opaque kv)."""
        b, t = input_ids.shape
        past_mask = attention_mask[:, :attention_mask.shape[1] - t]  # (B, L_past)
        if past is None:
            kv = StaticKV(self._new_buffers(b), np.zeros(b, np.int64), 0)
        elif isinstance(past, PendingKV):
            kv = self._materialize(past, past_mask)
        elif isinstance(past, StaticKV):
            kv = past
        else:
            raise TypeError(f"{type(past).__name__} is not a static KV cache")
        if t > 1 and kv.lengths.any():
            raise ValueError("engine.onnx runs a multi-token step only on an empty cache")
        new = attention_mask[:, -t:].sum(axis=1).astype(np.int64)  # (B,) real new tokens
        total = kv.lengths + new  # (B,)
        if int(total.max()) > self.max_len:
            raise ValueError(f"sequence of {int(total.max())} tokens exceeds max_seq_len "
                             f"{self.max_len}")
        ids, pos = input_ids, position_ids  # (B, T): a decode column needs no change
        if t > 1:  # left-padded prompts → right-padded: row i's tokens in columns 0..new_i-1
            ids, pos = np.zeros((b, t), np.int64), np.zeros((b, t), np.int64)
            for row in range(b):
                ids[row, :new[row]] = input_ids[row, t - new[row]:]
                pos[row, :new[row]] = position_ids[row, t - new[row]:]
        binding = self.session.io_binding()
        binding.bind_output(io.LOGITS, "cpu")
        binding.bind_cpu_input(io.INPUT_IDS, ids)
        binding.bind_cpu_input(io.POSITION_IDS, pos)
        binding.bind_cpu_input(es.SEQLENS_K, (total - 1).astype(np.int32))  # (B,)
        binding.bind_cpu_input(es.TOTAL_SEQUENCE_LENGTH,
                               np.array([int(total.max()) if t == 1 else t], np.int32))
        for name, value in zip(self._past, kv.buffers, strict=True):
            binding.bind_ortvalue_input(name, value)
        for name, value in zip(self._present, kv.buffers, strict=True):
            binding.bind_ortvalue_output(name, value)  # same memory: written in place
        self.session.run_with_iobinding(binding)
        logits_r = binding.get_outputs()[0].numpy()  # (B, T, V), right-padded rows
        kv.lengths = total
        kv.width = attention_mask.shape[1]
        rows = np.arange(b)
        if not all_logits:
            return logits_r[rows, new - 1][:, None, :], kv  # (B, 1, V)
        logits = np.zeros_like(logits_r)  # (B, T, V), back to the batch's left padding
        for row in range(b):
            logits[row, t - new[row]:] = logits_r[row, :new[row]]
        return logits, kv

    def kv_to_numpy(self, kv: Any) -> list[np.ndarray]:
        """The cache as left-padded arrays (B, nh, width, hs), the layout filter expects."""
        if isinstance(kv, PendingKV):
            return kv.arrays
        width = kv.width
        out = []
        for buf in kv.buffers:
            src = buf.numpy()  # (B, nh, M, hs)
            arr = np.zeros((src.shape[0], src.shape[1], width, src.shape[3]), np.float32)
            for row, n in enumerate(kv.lengths):
                arr[row, :, width - n:] = src[row, :, :n]
            out.append(arr)
        return out

    def kv_from_numpy(self, arrays: Sequence[np.ndarray]) -> Any:
        return PendingKV([np.ascontiguousarray(a, dtype=np.float32) for a in arrays])
