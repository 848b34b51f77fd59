"""Random-weight GPT-2 models built locally with transformers, for the import parity tests.

Nothing is downloaded: a GPT2LMHeadModel is built from a GPT2Config, its weights are
randomised (biases and LayerNorms included, so a dropped bias cannot pass unnoticed) and
saved with ``save_pretrained(safe_serialization=True)``, next to a byte-level BPE
tokenizer trained in the test. As in GPT-2, ``<|endoftext|>`` is the last id, is both
bos and eos, and there is no pad token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

ENDOFTEXT = "<|endoftext|>"

TokenizerFiles = Literal["tokenizer.json", "vocab+merges"]


def sample_texts(n_chars: int = 60_000) -> list[str]:
    """Chunks of the built-in stdlib corpus (English prose and code identifiers)."""
    from model.data import read_documents, stdlib_corpus_path

    text = "\n\n".join(read_documents(stdlib_corpus_path()))[:n_chars]
    return [text[i:i + 2000] for i in range(0, len(text), 2000)]


def write_tokenizer(out: Path, files: TokenizerFiles, vocab_size: int = 400) -> int:
    """Train a byte-level BPE on the stdlib corpus, write it in GPT-2's layout; the eos id.

    ``vocab+merges`` writes vocab.json (``<|endoftext|>`` appended as the last id, as in
    GPT-2's own file) and merges.txt; ``tokenizer.json`` writes the full tokenizer with
    ``<|endoftext|>`` added as a special token after the learned vocabulary.
    """
    from tokenizers import AddedToken, ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(sample_texts(), vocab_size=vocab_size - 1, show_progress=False)
    out.mkdir(parents=True, exist_ok=True)
    if files == "vocab+merges":
        bpe.save_model(str(out))
        vocab = json.loads((out / "vocab.json").read_text("utf-8"))
        eos = len(vocab)
        vocab[ENDOFTEXT] = eos
        (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), "utf-8")
        special = {"bos_token": ENDOFTEXT, "eos_token": ENDOFTEXT, "unk_token": ENDOFTEXT}
        (out / "special_tokens_map.json").write_text(json.dumps(special), "utf-8")
        (out / "tokenizer_config.json").write_text(json.dumps(
            {**special, "tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False,
             "model_max_length": 1024}), "utf-8")
        return eos
    bpe.add_special_tokens([AddedToken(ENDOFTEXT, special=True, normalized=False)])
    eos = bpe.token_to_id(ENDOFTEXT)
    bpe.save(str(out / "tokenizer.json"))
    return int(eos)


def randomise(model: Any, seed: int, std: float = 0.1) -> None:
    """Every parameter random: weights N(0, std), LayerNorm scales near 1, biases nonzero."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if ".ln_" in name or name.startswith(("transformer.ln_f", "ln_f")):
                p.copy_((1.0 + 0.1 * noise) if name.endswith("weight") else 0.05 * noise)
            else:
                p.copy_(std * noise)


def gpt2_config(vocab_size: int, eos: int, **overrides: Any) -> Any:
    """A GPT2Config like the real gpt2's (bos = eos = <|endoftext|>, no pad), resized."""
    from transformers import GPT2Config

    values: dict[str, Any] = {"vocab_size": vocab_size, "n_positions": 64, "n_embd": 32,
                              "n_layer": 2, "n_head": 4, "bos_token_id": eos,
                              "eos_token_id": eos, "activation_function": "gelu_new"}
    values.update(overrides)
    return GPT2Config(**values)


def build_hf_model(out: Path, files: TokenizerFiles = "tokenizer.json", seed: int = 0,
                   std: float = 0.1, max_shard_size: str | None = None,
                   **config: Any) -> Path:
    """Tokenizer + random-weight GPT2LMHeadModel saved as safetensors in ``out``."""
    import torch
    from transformers import GPT2LMHeadModel

    eos = write_tokenizer(out, files)
    cfg = gpt2_config(eos + 1, eos, **config)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg).eval()
    randomise(model, seed, std)
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(out), **kwargs)
    return out


def load_hf_model(path: Path) -> Any:
    """The saved model back in transformers, eager attention (so attentions are returned)."""
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(str(path), attn_implementation="eager").eval()
