"""The ``smollm2-135m`` preset: SmolLM2-135M's shape with random weights, no download.

transformers builds ``LlamaForCausalLM`` from SmolLM2-135M's published configuration
(30 layers, d 576, 9 query heads and 3 key/value heads of 64 dimensions, SwiGLU 1536,
RMSNorm ε 1e-5, rope θ 100,000, tied embeddings, 49,152 ids, 8,192 positions) with its own
initialisation (seed 0) and saves it as a Hugging Face directory; ``attnserve import``
turns it into our checkpoint and the peers (transformers, CTranslate2) load the very same
directory.

The tokenizer is the gpt2 preset's: a byte-level BPE trained on the stdlib corpus, its
vocabulary filled to 49,152 ids with unreachable ``<|unusedN|>`` entries and
``<|endoftext|>`` last (bos = eos). SmolLM2's own tokenizer (its ChatML ids 0–2) cannot
be fetched; the engines are fed token ids, so only the vocabulary size matters to speed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.lib.gpt2_preset import import_built, learned_token_count, write_tokenizer

PRESET = "smollm2-135m"
SEED = 0
# HuggingFaceTB/SmolLM2-135M config.json, the fields that shape the computation.
SMOLLM2_135M: dict[str, Any] = {
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
    "vocab_size": 49152, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
}


def build_hf_smollm2(out: Path, seed: int = SEED) -> dict[str, int]:
    """Random-weight SmolLM2-135M shape as a Hugging Face directory (safetensors); sizes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    eos = write_tokenizer(out, SMOLLM2_135M["vocab_size"],
                          model_max_length=SMOLLM2_135M["max_position_embeddings"])
    config = LlamaConfig(**SMOLLM2_135M, bos_token_id=eos, eos_token_id=eos)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    return {"params": int(model.num_parameters()), "vocab_size": config.vocab_size,
            "learned_tokens": learned_token_count(out), "eos_token_id": eos}


def prepare_smollm2(work: Path) -> tuple[Path, Path, str]:
    """(checkpoint, HF directory, description) for the smollm2-135m preset under ``work``."""
    return import_built(work, "hf-smollm2", build_hf_smollm2,
                        "transformers LlamaForCausalLM, SmolLM2-135M's config")

