"""Random-weight Llama, Qwen2, Qwen3, SmolLM3, Mistral and Phi-3 models built locally with
transformers, for import parity.

Nothing is downloaded: a LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM is built
from its config, every parameter randomised (RMSNorm scales near 1, Qwen2's Q/K/V biases
nonzero, Qwen3's per-head query/key norms near 1 and its heads twice d_model / n_heads
wide, SmolLM3's second layer without rotary, so a dropped bias, a norm read as identity, a
head width taken from d_model or a rotation where there is none cannot pass; Mistral's
window of 5 positions, shorter than every test prompt; Phi-3's fused projections and window
of 6), and saved with
``save_pretrained(safe_serialization=True)`` beside a byte-level BPE tokenizer trained on
the stdlib corpus with ChatML special tokens, as SmolLM2 and Qwen2.5 have. Llama
directories carry the chat template inside tokenizer_config.json, Qwen2 and Qwen3 ones in
chat_template.jinja: the two places transformers reads it from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIALS = (ENDOFTEXT, IM_START, IM_END)
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

Family = Literal["llama", "qwen2", "qwen3", "smollm3", "mistral", "phi3", "gemma3"]
QWEN = ("qwen2", "qwen3")  # Qwen2's tokenizer layout; the others Llama's


def write_tokenizer(out: Path, family: Family, vocab_size: int = 400) -> dict[str, int]:
    """tokenizer.json + tokenizer_config.json (+ chat_template.jinja for qwen2); ids."""
    from tokenizers import AddedToken, ByteLevelBPETokenizer

    from tests.hf_gpt2 import sample_texts

    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(sample_texts(), vocab_size=vocab_size - len(SPECIALS),
                            show_progress=False)
    bpe.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    out.mkdir(parents=True, exist_ok=True)
    bpe.save(str(out / "tokenizer.json"))
    ids = {t: int(bpe.token_to_id(t)) for t in SPECIALS}
    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": IM_END,
        "pad_token": ENDOFTEXT if family in QWEN else IM_END,
        "bos_token": None if family in QWEN else IM_START, "unk_token": None,
        "model_max_length": 2048, "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {str(ids[t]): {"content": t, "special": True, "lstrip": False,
                                               "rstrip": False, "normalized": False,
                                               "single_word": False} for t in SPECIALS},
    }
    if family not in QWEN:
        tok_config["chat_template"] = CHATML
    else:
        (out / "chat_template.jinja").write_text(CHATML, "utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1), "utf-8")
    return ids


def randomise(model: Any, seed: int, std: float = 0.1) -> None:
    """Weights N(0, std), norm scales 1 ± 0.1, biases N(0, 0.05)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.05 * noise)
            else:
                p.copy_(std * noise)


def hf_config(family: Family, vocab_size: int, ids: dict[str, int], **overrides: Any) -> Any:
    """A small LlamaConfig / Qwen2Config / Qwen3Config, GQA (2 key/value heads for 4 query
    heads of 16 dimensions: the smallest GroupQueryAttention's rotary kernel takes; Qwen3's
    heads 32 wide, Q twice d_model)."""
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        SmolLM3Config,
    )

    values: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 56,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": family != "llama", "eos_token_id": ids[IM_END],
        "bos_token_id": ids[ENDOFTEXT] if family in QWEN else ids[IM_START],
        "pad_token_id": None,
    }
    if family == "qwen3":
        values["head_dim"] = 32
    if family == "smollm3":  # the second layer without rotary (SmolLM3: every fourth)
        values["no_rope_layers"] = [1, 0]
    if family == "mistral":  # each layer sees its last 5 positions: shorter than the prompts
        values["sliding_window"] = 5
    if family == "gemma3":  # a window layer then a global one; heads of 32; Gemma's scale
        values.update(head_dim=32, sliding_window=5, query_pre_attn_scalar=24,
                      layer_types=["sliding_attention", "full_attention"],
                      rope_local_base_freq=10000.0, rope_theta=1000000.0,
                      hidden_activation="gelu_pytorch_tanh")
    if family == "phi3":  # fused projections, a window as the 4k models have (2,047 there)
        values.update(sliding_window=6, original_max_position_embeddings=128,
                      tie_word_embeddings=False)
    values.update(overrides)
    return {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
            "smollm3": SmolLM3Config, "mistral": MistralConfig,
            "phi3": Phi3Config, "gemma3": Gemma3TextConfig}[family](**values)


def build_hf_model(out: Path, family: Family, seed: int = 0, vocab_size: int = 400,
                   **overrides: Any) -> Any:
    """Write a complete model directory; return the eval-mode transformers model (eager)."""
    import torch
    from transformers import (
        Gemma3ForCausalLM,
        GenerationConfig,
        LlamaForCausalLM,
        MistralForCausalLM,
        Phi3ForCausalLM,
        Qwen2ForCausalLM,
        Qwen3ForCausalLM,
        SmolLM3ForCausalLM,
    )

    ids = write_tokenizer(out, family, vocab_size)
    config = hf_config(family, vocab_size, ids, **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM,
             "smollm3": SmolLM3ForCausalLM, "mistral": MistralForCausalLM,
             "phi3": Phi3ForCausalLM, "gemma3": Gemma3ForCausalLM}[family](config)
    randomise(model, seed)
    model.eval()
    model.save_pretrained(str(out), safe_serialization=True)
    # Two stop ids, as the instruction-tuned Qwen2.5 declares: <|im_end|> first.
    GenerationConfig(bos_token_id=config.bos_token_id,
                     eos_token_id=[ids[IM_END], ids[ENDOFTEXT]],
                     do_sample=False).save_pretrained(str(out))
    return model


@dataclass(frozen=True)
class LlamaBuild:
    """A random-weight HF model directory, its attnserve import and its exported artifact
    (model.onnx, attention.onnx and engine.onnx)."""

    family: Family
    hf_dir: Path
    checkpoint: Path
    artifact: Path


def build_llama_artifact(root: Path, family: Family, seed: int = 0) -> LlamaBuild:
    from export.to_onnx import export_artifact
    from model.hf_import import import_hf_checkpoint

    build_hf_model(root / "hf", family, seed=seed)
    import_hf_checkpoint(root / "hf", root / "ckpt")
    export_artifact(root / "ckpt", root / "artifact", engine_graph=True)
    return LlamaBuild(family, root / "hf", root / "ckpt", root / "artifact")


def load_hf_model(path: Path) -> Any:
    """The saved model back in transformers, eager attention (attentions are returned)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval()
