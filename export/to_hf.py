"""Write a checkpoint as a Hugging Face transformers model (config.json + safetensors).

Usage (through the export CLI):
    attnserve export --format hf --ckpt checkpoints/default --out hf/default

The config.json and the tensor names and layouts are the architecture's
(model/architectures/): a GPT checkpoint becomes a GPT2LMHeadModel (pre-norm blocks, a
final LayerNorm, learned positions — a sinusoidal table is written into ``wpe`` and
reproduces ours exactly — attention biases or zeros, Conv1D (in, out) matrices), a Llama
one a LlamaForCausalLM (Qwen2ForCausalLM when it has Q/K/V biases alone), a renaming. A
model imported from transformers comes back bit-identical. The copy exists so that a
benchmark against transformers runs on the very same weights; transformers itself is
not needed to write it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from model.architectures import architecture
from model.checkpoint import TOKENIZER_FILE, load_checkpoint
from model.config import GPTConfig
from model.staging import staged_directory

HF_CONFIG_FILE = "config.json"
HF_WEIGHTS_FILE = "model.safetensors"
HF_TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
HF_GENERATION_CONFIG_FILE = "generation_config.json"
def _tokenizer_config(config: GPTConfig, special: dict[str, Any],
                      tokenizer_path: Path) -> dict[str, Any]:
    """Lets transformers' AutoTokenizer wrap our tokenizer.json as a fast tokenizer.

    The special tokens are named from the checkpoint's ids (``<pad>``/``<start>``/``<end>``
    for ours, ``<|endoftext|>`` for GPT-2); a missing one (GPT-2's pad) stays unset.
    """
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    out: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": config.max_seq_len,
        "clean_up_tokenization_spaces": False,
    }
    for kind in ("pad", "bos", "eos"):
        token_id = special.get(f"{kind}_token_id")
        token = tok.id_to_token(token_id) if token_id is not None else None
        if token is not None:
            out[f"{kind}_token"] = token
    return out


def export_hf(
    ckpt_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], force: bool = False
) -> Path:
    """Write ``ckpt_dir`` as a transformers model directory at ``out_dir``; return its path.

    Built in a temporary sibling directory and renamed into place; an existing non-empty
    ``out_dir`` is refused unless ``force``.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"output directory {out} is not empty; pass --force to overwrite")
    ckpt = load_checkpoint(ckpt_dir)
    config: GPTConfig = ckpt.meta.model
    special = {k: ckpt.meta.tokenizer.get(k) for k in
               ("pad_token_id", "bos_token_id", "eos_token_id")}
    arch = architecture(config.arch)
    hf_cfg, tensors = arch.hf_config(config, special), arch.state_dict_to_hf(ckpt.model)

    with staged_directory(out) as tmp:
        save_file(tensors, str(tmp / HF_WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / HF_CONFIG_FILE).write_text(json.dumps(hf_cfg, indent=2), encoding="utf-8")
        generation = {k: v for k, v in special.items() if v is not None}
        (tmp / HF_GENERATION_CONFIG_FILE).write_text(
            json.dumps(generation, indent=2), encoding="utf-8")
        shutil.copyfile(ckpt.tokenizer_path, tmp / TOKENIZER_FILE)
        (tmp / HF_TOKENIZER_CONFIG_FILE).write_text(
            json.dumps(_tokenizer_config(config, special, ckpt.tokenizer_path), indent=2),
            encoding="utf-8")
    return out
