"""The model a fine-tune trains: the checkpoint's base with its adapter, and its loss.

The base is loaded in the form the checkpoint holds it: a GGUF file's blocks stay blocks
(model/finetune/frozen.py), float32 weights stay float32; frozen for LoRA, all of it
trained (float32, dequantised once) for a full fine-tune. The forward scores a
right-padded batch: each position predicts the next token, scored where the label says
(model/finetune/supervision.py); padding sits after every real token, so causal attention
keeps it out of the real positions without a mask. Gradient checkpointing keeps only each
layer's input and recomputes the layer in the backward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from model.checkpoint import (
    GGUF_WEIGHTS_FILE,
    CheckpointMeta,
    load_checkpoint,
    read_meta,
    weights_path,
)
from model.finetune.frozen import FrozenLinear, frozen_gguf_model
from model.finetune.lora import Adapter
from model.finetune.loss import supervised_loss
from model.finetune.supervision import IGNORE  # a label not scored (the prompt, padding)


def load_base(ckpt_dir: Path, full: bool) -> tuple[Any, CheckpointMeta, int]:
    """(model.gpt.GPT, its checkpoint meta, bytes of weights held as GGUF blocks). For
    LoRA every parameter is frozen; for ``full`` every one trains, in float32."""
    meta = read_meta(ckpt_dir)
    if not full and weights_path(ckpt_dir).name == GGUF_WEIGHTS_FILE:
        model, held = frozen_gguf_model(ckpt_dir, meta.model)
        return model, meta, held
    model = load_checkpoint(ckpt_dir).model
    model.requires_grad_(full)
    return model, meta, 0


class TunedModel(nn.Module):
    """``forward(ids, labels)`` → (Σ cross-entropy over the scored positions, argmax hits),
    for the base with ``adapter`` wired in (None: a full fine-tune)."""

    def __init__(self, model: Any, adapter: Adapter | None, checkpointing: bool) -> None:
        super().__init__()
        self.model = model
        self.adapter = adapter  # registered here, so DistributedDataParallel syncs its grads
        self.checkpointing = checkpointing

    def _layer(self, i: int, x: Tensor, context: Any) -> Tensor:
        out: Tensor = self.model.layer(i, x, context, None)[0]
        return out

    def forward(self, ids: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """ids, labels (B, T); labels[t] is what position t − 1 should predict."""
        gpt = self.model
        x, context = gpt.embed(ids, None, None, 0)  # (B, T, d)
        for i in range(len(gpt.blocks)):
            if self.checkpointing and self.training:
                x = checkpoint(self._layer, i, x, context, use_reentrant=False)
            else:
                x = self._layer(i, x, context)
        targets = labels[:, 1:]  # (B, T − 1)
        scored = targets != IGNORE
        h = gpt.ln_f(x[:, :-1][scored])  # (N, d): only the positions with a label
        return supervised_loss(h, head_weight(gpt), targets[scored])


def head_weight(gpt: Any) -> Tensor:
    """The LM head's (V, d) weight: a held head dequantised for this batch (no gradient),
    else the parameter itself (with its gradient when it trains)."""
    head = gpt.lm_head
    if isinstance(head, FrozenLinear):
        with torch.no_grad():
            return head.held.dequantize()
    weight: Tensor = head.weight
    return weight


def padded(rows: list[tuple[list[int], list[int]]], pad_id: int,
           device: torch.device) -> tuple[Tensor, Tensor]:
    """(ids, labels) of one micro-batch, right-padded to its longest row: (B, T) each."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for r, (row_ids, row_labels) in enumerate(rows):
        ids[r, :len(row_ids)] = torch.tensor(row_ids)
        labels[r, :len(row_labels)] = torch.tensor(row_labels)
    return ids.to(device), labels.to(device)
