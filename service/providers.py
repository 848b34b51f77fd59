"""The service's ONNX Runtime sessions: provider selection for a ``--device``.

The sessions themselves come from the one factory (service/contract/sessions.py); this
picks the providers and refuses to start when CUDA was asked for and is not there.
"""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort

from service.contract import sessions
from service.settings import Device

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
                   prepack: bool = True, spin_wait: bool = True,
                   cuda_graphs: bool = False) -> ort.InferenceSession:
    """A session on ``device``'s providers, refusing to start if CUDA was asked for and
    ONNX Runtime cannot use it. ``cuda_graphs``: the CUDA provider may capture and replay
    runs (``gpu_graph_id``, service/engine/cuda.py)."""
    providers: list[str | tuple[str, dict[str, str]]] = list(select_providers(device))
    if cuda_graphs:
        providers = [(CUDA, {"enable_cuda_graph": "1"}) if p == CUDA else p for p in providers]
    session = sessions.create_session(path, threads=intra_op_threads, providers=providers,
                                      prepack=prepack, spin_wait=spin_wait)
    active = session.get_providers()[0]
    if device == "cuda" and active != CUDA:
        raise DeviceError(f"--device cuda: ONNX Runtime could not use CUDA for {path.name} "
                          f"(active provider {active}); is a GPU visible?")
    return session
