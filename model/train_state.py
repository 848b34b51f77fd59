"""The optimizer and its state on disk, so that `attnserve train --resume` is exact.

AdamW's moments are stored beside the checkpoint as ``train_state.safetensors`` with keys
``<parameter name>.exp_avg``, ``.exp_avg_sq`` and ``.step`` and the global step in the
metadata: plain tensors, no pickle, readable by any safetensors reader.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from model.gpt import GPT

TRAIN_STATE_FILE = "train_state.safetensors"


def make_optimizer(model: GPT, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """Decay matrices and embeddings; leave biases and LayerNorm gains alone (nanoGPT)."""
    decay = [p for _, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for _, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def _param_names(model: GPT, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    names = {id(p): n for n, p in model.named_parameters()}
    ordered = [p for group in optimizer.param_groups for p in group["params"]]
    return {i: names[id(p)] for i, p in enumerate(ordered)}


def save_train_state(out: Path, model: GPT, optimizer: torch.optim.Optimizer, step: int) -> None:
    """AdamW moments as safetensors (keys ``<param>.<moment>``), written atomically."""
    from safetensors.torch import save_file

    names = _param_names(model, optimizer)
    tensors = {f"{names[i]}.{key}": value.detach().cpu().contiguous().reshape(-1)
               if key == "step" else value.detach().cpu().contiguous()
               for i, state in optimizer.state_dict()["state"].items()
               for key, value in state.items()}
    tmp = out / f".{TRAIN_STATE_FILE}.tmp-{os.getpid()}"
    save_file(tensors, str(tmp), metadata={"step": str(step)})
    os.replace(tmp, out / TRAIN_STATE_FILE)


def load_train_state(out: Path, model: GPT, optimizer: torch.optim.Optimizer, step: int) -> bool:
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
