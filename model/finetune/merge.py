"""`attnserve merge`: a LoRA adapter folded into its base, as a new float32 checkpoint.

W' = W + s·B·A for every adapted projection, computed in float32 on the base's float32
weights (a GGUF base dequantised as `import --float32` would): merging into 4-bit blocks
would round the update away or change the base (peft#2321), so the merged checkpoint holds
float weights, and `export --quantize` may quantise it again. Any PEFT LoRA adapter for a
base of the same shapes merges (ours, TRL's, PEFT's, unsloth's); what a merge cannot
reproduce exactly is refused with one line before anything is loaded or written
(model/finetune/peft_format.py).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from model.checkpoint import (
    TOKENIZER_FILE,
    CheckpointMeta,
    carried_files,
    load_checkpoint,
    read_meta,
    save_checkpoint,
)
from model.finetune.lora import merged_weights
from model.finetune.options import check_output
from model.finetune.peft_format import WEIGHTS_FILE, read_adapter


def merge(ckpt_dir: str | Path, adapter_dir: str | Path, out: str | Path,
          force: bool = False) -> Path:
    """Write ``out``: the checkpoint ``ckpt_dir`` with the adapter merged; return it."""
    ckpt_dir, adapter_dir, out = Path(ckpt_dir), Path(adapter_dir), Path(out)
    check_output(out, resume=False, force=force)
    meta = read_meta(ckpt_dir)
    adapter = read_adapter(adapter_dir, meta.model)  # refusals before the weights load
    model = load_checkpoint(ckpt_dir).model
    with torch.no_grad():
        for name, weight in merged_weights(model, adapter).items():
            model.get_parameter(name).copy_(weight)
    training: dict[str, Any] = {"merged_from": {
        "checkpoint": str(ckpt_dir.resolve()), "adapter": str(adapter_dir.resolve()),
        "adapter_sha256": hashlib.sha256((adapter_dir / WEIGHTS_FILE).read_bytes()).hexdigest(),
        "modules": len(adapter.loras), "base_training": meta.training}}
    return save_checkpoint(out, model, CheckpointMeta(meta.model, dict(meta.tokenizer), training),
                           (ckpt_dir / TOKENIZER_FILE).read_text("utf-8"),
                           extra_files=carried_files(ckpt_dir))
