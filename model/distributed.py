"""The little that data-parallel training needs from torch.distributed.

`attnserve train` runs unchanged under ``torchrun --nproc_per_node N``: torchrun sets
RANK, WORLD_SIZE and LOCAL_RANK, and we join a process group (gloo on CPU, nccl on CUDA).
Objects are exchanged as UTF-8 bytes in tensors, never with broadcast_object_list, which
pickles.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_info() -> DistInfo:
    """What torchrun told this process; a plain run is rank 0 of 1."""
    try:
        return DistInfo(rank=int(os.environ.get("RANK", "0")),
                        world_size=int(os.environ.get("WORLD_SIZE", "1")),
                        local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    except ValueError as exc:
        raise ValueError(f"bad torchrun environment (RANK/WORLD_SIZE/LOCAL_RANK): {exc}") from exc


def init(info: DistInfo, device: torch.device) -> None:
    if info.enabled and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def broadcast_text(text: str | None, info: DistInfo, device: torch.device) -> str:
    """Rank 0's ``text`` on every rank (length first, then the bytes)."""
    if not info.enabled:
        assert text is not None
        return text
    payload = (text or "").encode("utf-8") if info.is_main else b""
    length = torch.tensor([len(payload)], dtype=torch.long, device=device)
    dist.broadcast(length, src=0)
    buffer = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
    if info.is_main:
        buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    dist.broadcast(buffer, src=0)
    return buffer.cpu().numpy().tobytes().decode("utf-8")


def sum_across(values: list[float], info: DistInfo, device: torch.device) -> list[float]:
    """Element-wise sum over ranks (identity when not distributed)."""
    if not info.enabled:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()
