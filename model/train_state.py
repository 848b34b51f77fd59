"""The optimizer and its state on disk, so that `attnserve train --resume` is exact.

AdamW's moments are stored beside the checkpoint as ``train_state.safetensors`` with keys
``<parameter name>.exp_avg``, ``.exp_avg_sq`` and ``.step`` and the global step in the
metadata: plain tensors, no pickle, readable by any safetensors reader.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from model.checkpoint import TRAIN_STATE_FILE


def make_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """Decay matrices and embeddings; leave biases and LayerNorm gains alone (nanoGPT)."""
    decay = [p for _, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for _, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    names = {id(p): n for n, p in model.named_parameters()}
    ordered = [p for group in optimizer.param_groups for p in group["params"]]
    return {i: names[id(p)] for i, p in enumerate(ordered)}


def _moments(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    names = _param_names(model, optimizer)
    return {f"{names[i]}.{key}": value.detach().cpu().contiguous().reshape(-1)
            if key == "step" else value.detach().cpu().contiguous()
            for i, state in optimizer.state_dict()["state"].items()
            for key, value in state.items()}


def train_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> bytes:
    """AdamW moments as a safetensors file's bytes, for a writer that stages it with the
    rest of a directory (an adapter's: a few MB)."""
    from safetensors.torch import save

    return bytes(save(_moments(model, optimizer), metadata={"step": str(step)}))


def save_train_state(out: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                     step: int) -> None:
    """AdamW moments as ``train_state.safetensors`` in ``out`` (keys ``<param>.<moment>``),
    written atomically and straight from the tensors (no copy of a model's 1 GB)."""
    from safetensors.torch import save_file

    tmp = out / f".{TRAIN_STATE_FILE}.tmp-{os.getpid()}"
    save_file(_moments(model, optimizer), str(tmp), metadata={"step": str(step)})
    os.replace(tmp, out / TRAIN_STATE_FILE)


def load_train_state(out: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                     step: int) -> bool:
    """Restore AdamW moments saved at ``step``; False when absent or from another step."""
    from safetensors import safe_open

    path = out / TRAIN_STATE_FILE
    if not path.is_file():
        return False
    with safe_open(str(path), framework="pt") as handle:
        if (handle.metadata() or {}).get("step") != str(step):
            return False
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    state_dict = optimizer.state_dict()
    device = next(model.parameters()).device
    for i, name in _param_names(model, optimizer).items():
        moments = {key.removeprefix(f"{name}."): value for key, value in tensors.items()
                   if key.startswith(f"{name}.") and "." not in key.removeprefix(f"{name}.")}
        if set(moments) != {"step", "exp_avg", "exp_avg_sq"}:
            return False
        state_dict["state"][i] = {
            "step": moments["step"].reshape(()),
            "exp_avg": moments["exp_avg"].to(device),
            "exp_avg_sq": moments["exp_avg_sq"].to(device),
        }
    optimizer.load_state_dict(state_dict)
    return True
