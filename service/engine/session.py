"""ONNX Runtime sessions for model.onnx and attention.onnx, with provider selection.

``OnnxModel`` implements the batch's ModelRunner by the names in service/contract/io_spec.py. Each
forward pass goes through an IO binding: the presents stay OrtValues owned by ONNX
Runtime (on the GPU under CUDA) and are bound as the next step's pasts without a copy;
only the logits come back to host memory.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnxruntime as ort

from service.contract import io_spec as io
from service.contract import sessions
from service.engine.stats import KVStats
from service.settings import Device

if TYPE_CHECKING:
    from service.engine.static_cache import PoolConfig

log = logging.getLogger("attnserve.session")

CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"


class DeviceError(ValueError):
    """The requested device is not available: refuse to start rather than fall back."""


def select_providers(device: Device) -> list[str]:
    available = ort.get_available_providers()
    if device == "cpu":
        return [CPU]
    if CUDA in available:
        return [CUDA, CPU]
    if device == "cuda":
        raise DeviceError(
            "--device cuda: onnxruntime has no CUDAExecutionProvider here (available: "
            f"{', '.join(available)}); install onnxruntime-gpu with a CUDA GPU, or use "
            "--device cpu")
    return [CPU]


def create_session(path: Path, device: Device, intra_op_threads: int,
                   prepack: bool = True) -> ort.InferenceSession:
    """A session on ``device``'s providers, refusing to start if CUDA was asked for and
    ONNX Runtime cannot use it."""
    session = sessions.create_session(path, threads=intra_op_threads,
                                      providers=select_providers(device), prepack=prepack)
    active = session.get_providers()[0]
    if device == "cuda" and active != CUDA:
        raise DeviceError(f"--device cuda: ONNX Runtime could not use CUDA for {path.name} "
                          f"(active provider {active}); is a GPU visible?")
    return session


class OnnxModel:
    """model.onnx with a KV cache: prefill and decode through one IO-bound forward."""

    def __init__(self, session: ort.InferenceSession, config: io.ArtifactConfig) -> None:
        self.session = session
        self.config = config
        self.vocab_size = config.vocab_size
        self.graph_file = io.MODEL_FILE
        self.provider = session.get_providers()[0]
        self.device = "cuda" if self.provider == CUDA else "cpu"
        self.kv_dtype = np.dtype(config.kv_dtype)
        self._past = io.past_names(config.n_layers)
        self._present = io.present_names(config.n_layers)
        inputs = {i.name for i in session.get_inputs()}
        outputs = {o.name for o in session.get_outputs()}
        missing = sorted(({*io.model_input_names(config.n_layers)} - inputs)
                         | ({*io.model_output_names(config.n_layers)} - outputs))
        if missing:
            raise ValueError(f"model.onnx does not follow the I/O contract: missing {missing}")

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray,
                position_ids: np.ndarray, past: Sequence[Any] | None,
                all_logits: bool) -> tuple[np.ndarray, list[Any]]:
        if past is None:
            past = self.empty_kv(input_ids.shape[0])
        binding = self.session.io_binding()
        binding.bind_cpu_input(io.INPUT_IDS, input_ids)  # (B, T)
        binding.bind_cpu_input(io.ATTENTION_MASK, attention_mask)  # (B, T_past + T)
        binding.bind_cpu_input(io.POSITION_IDS, position_ids)  # (B, T)
        for name, value in zip(self._past, past, strict=True):
            binding.bind_ortvalue_input(name, value)  # (B, nh, T_past, hs)
        binding.bind_output(io.LOGITS, "cpu")
        for name in self._present:
            binding.bind_output(name, self.device)  # (B, nh, T_past + T, hs) stays put
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        logits = outputs[0].numpy()  # (B, T, V)
        if not all_logits:
            logits = logits[:, -1:, :]  # (B, 1, V)
        return logits, list(outputs[1:])

    def empty_kv(self, batch: int) -> list[Any]:
        shape = (batch, self.config.kv_heads, 0, self.config.head_dim)  # (B, nkv, 0, hs)
        return self.kv_from_numpy([np.zeros(shape, self.kv_dtype) for _ in self._past])

    def kv_to_numpy(self, kv: Sequence[Any]) -> list[np.ndarray]:
        return [v.numpy() for v in kv]

    # model.onnx's cache is the batch's own left-padded tensors: a change of composition
    # copies every row (device → host → device under CUDA). engine.onnx's pool does not.

    def kv_filter(self, kv: Sequence[Any], rows: Sequence[int], trim: int) -> list[Any] | None:
        """Rows ``rows`` of the cache without its first ``trim`` (padding) columns."""
        if not len(rows):
            return None
        index = np.asarray(rows, dtype=np.int64)
        return self.kv_from_numpy([np.ascontiguousarray(a[index, :, trim:, :])
                                   for a in self.kv_to_numpy(kv)])

    def kv_concat(self, kvs: Sequence[Any], widths: Sequence[int], width: int) -> list[Any]:
        """One left-padded cache (B, nh, width, hs) of all batches' rows (one copy)."""
        per_batch = [self.kv_to_numpy(kv) for kv in kvs]
        total = sum(a[0].shape[0] for a in per_batch)
        out = [np.zeros((total, a.shape[1], width, a.shape[3]), dtype=a.dtype)
               for a in per_batch[0]]  # each (B, nh, L, hs)
        start = 0
        for arrays, w in zip(per_batch, widths, strict=True):
            end = start + arrays[0].shape[0]
            for dst, src in zip(out, arrays, strict=True):
                dst[start:end, :, width - w:, :] = src
            start = end
        return self.kv_from_numpy(out)

    def kv_stats(self, kv: Sequence[Any] | None) -> KVStats:
        """The running batch's tensors: rows, tokens and bytes, padding included."""
        if not kv:
            return KVStats(slots=0, slots_used=0, tokens=0, capacity_tokens=0,
                           bytes_allocated=0)
        b, _, width, _ = kv[0].shape()
        nbytes = sum(int(np.prod(v.shape())) for v in kv) * self.kv_dtype.itemsize
        return KVStats(slots=b, slots_used=b, tokens=b * width, capacity_tokens=0,
                       bytes_allocated=nbytes)

    def kv_from_numpy(self, arrays: Sequence[np.ndarray]) -> list[Any]:
        return [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a), self.device, 0)
                for a in arrays]


def create_model(artifact_dir: Path, config: io.ArtifactConfig, device: Device,
                 intra_op_threads: int, engine_graph: bool = True,
                 pool: PoolConfig | None = None) -> Any:
    """The decode runner: engine.onnx over a KV pool when the artifact has it, else model.onnx.

    engine.onnx (written by ``attnserve export --engine-graph``) keeps a float32 cache on
    the host, so it is used only when the session would run on CPU anyway.
    """
    from service.contract.engine_spec import ENGINE_FILE

    engine_path = artifact_dir / ENGINE_FILE
    if engine_graph and engine_path.is_file() and select_providers(device) == [CPU]:
        from service.engine.static_cache import StaticCacheModel

        model = StaticCacheModel(create_session(engine_path, "cpu", intra_op_threads), config,
                                 pool)
        log.info("decoding with %s: KV pool of %d slots x %d tokens (%.1f MiB)%s", ENGINE_FILE,
                 model.pool.slots, model.max_len, model.pool.bytes_allocated / 2**20,
                 f", prefix cache of {model.prefix.capacity} blocks x "
                 f"{model.prefix.block_size} tokens" if model.prefix else "")
        return model
    return OnnxModel(create_session(artifact_dir / io.MODEL_FILE, device, intra_op_threads),
                     config)
