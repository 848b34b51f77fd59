"""Random-weight GPT-2 models built locally with transformers, for the import parity tests.

Nothing is downloaded: a GPT2LMHeadModel is built from a GPT2Config, its weights are
randomised (biases and LayerNorms included, so a dropped bias cannot pass unnoticed) and
saved with ``save_pretrained(safe_serialization=True)``, next to a byte-level BPE
tokenizer trained in the test. As in GPT-2, ``<|endoftext|>`` is the last id, is both
bos and eos, and there is no pad token.
"""

from __future__ import annotations

import functools
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

ENDOFTEXT = "<|endoftext|>"

TokenizerFiles = Literal["tokenizer.json", "vocab+merges"]


def sample_texts(n_chars: int = 60_000) -> list[str]:
    """Chunks of the built-in stdlib corpus (English prose and code identifiers)."""
    from model.data import read_documents, stdlib_corpus_path

    text = "\n\n".join(read_documents(stdlib_corpus_path()))[:n_chars]
    return [text[i:i + 2000] for i in range(0, len(text), 2000)]


@functools.cache
def _trained_bpe(vocab_size: int) -> tuple[str, str]:
    """vocab.json and merges.txt of a byte-level BPE trained once per process."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(sample_texts(), vocab_size=vocab_size, show_progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        bpe.save_model(tmp)
        return ((Path(tmp) / "vocab.json").read_text("utf-8"),
                (Path(tmp) / "merges.txt").read_text("utf-8"))


def write_tokenizer(out: Path, files: TokenizerFiles, vocab_size: int = 400) -> int:
    """Write a byte-level BPE trained on the stdlib corpus in GPT-2's layout; the eos id.

    ``<|endoftext|>`` is appended after the learned vocabulary as the last id, as in
    GPT-2. ``vocab+merges`` writes vocab.json, merges.txt and the tokenizer_config.json /
    special_tokens_map.json GPT2Tokenizer reads; ``tokenizer.json`` writes the full
    tokenizer with ``<|endoftext|>`` as a special added token.
    """
    from tokenizers import AddedToken, ByteLevelBPETokenizer

    vocab_text, merges_text = _trained_bpe(vocab_size - 1)
    vocab = json.loads(vocab_text)
    eos = len(vocab)
    out.mkdir(parents=True, exist_ok=True)
    if files == "vocab+merges":
        vocab[ENDOFTEXT] = eos
        (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), "utf-8")
        (out / "merges.txt").write_text(merges_text, "utf-8")
        special = {"bos_token": ENDOFTEXT, "eos_token": ENDOFTEXT, "unk_token": ENDOFTEXT}
        (out / "special_tokens_map.json").write_text(json.dumps(special), "utf-8")
        (out / "tokenizer_config.json").write_text(json.dumps(
            {**special, "tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False,
             "model_max_length": 1024}), "utf-8")
        return eos
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "vocab.json").write_text(vocab_text, "utf-8")
        (Path(tmp) / "merges.txt").write_text(merges_text, "utf-8")
        bpe = ByteLevelBPETokenizer.from_file(str(Path(tmp) / "vocab.json"),
                                              str(Path(tmp) / "merges.txt"))
    bpe.add_special_tokens([AddedToken(ENDOFTEXT, special=True, normalized=False)])
    assert bpe.token_to_id(ENDOFTEXT) == eos
    bpe.save(str(out / "tokenizer.json"))
    return eos


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


def route_to_eos(model: Any, prompt_ids: list[int], eos: int, min_step: int = 4,
                 horizon: int = 24) -> int:
    """Make greedy decoding of ``prompt_ids`` end with eos; return the step it comes at.

    Greedy decoding emits, at some step k ≥ ``min_step``, a token t seen neither in the
    prompt nor before. Swapping the rows of t and eos in the tied embedding relabels the
    two ids in input and output alike, an exact symmetry of the network, so the same
    decoding now emits eos at step k: a stop at GPT-2's eos without training a model.
    """
    import torch

    if not model.config.tie_word_embeddings:
        raise ValueError("route_to_eos relabels the tied embedding; untied heads need both")
    with torch.no_grad():
        seq = model.generate(torch.tensor([prompt_ids]), max_new_tokens=horizon,
                             do_sample=False, eos_token_id=None, pad_token_id=eos)
    new = seq[0, len(prompt_ids):].tolist()
    for k in range(min_step, len(new)):
        t = new[k]
        if t != eos and t not in prompt_ids and t not in new[:k] and eos not in new[:k]:
            wte = model.transformer.wte.weight
            with torch.no_grad():
                wte[[t, eos]] = wte[[eos, t]].clone()
            return k
    raise ValueError(f"no fresh token after step {min_step} in greedy output {new}")


def build_hf_model(out: Path, files: TokenizerFiles = "tokenizer.json", seed: int = 0,
                   std: float = 0.1, max_shard_size: str | None = None,
                   prepare: Callable[[Any], None] | None = None, **config: Any) -> Path:
    """Tokenizer + random-weight GPT2LMHeadModel saved as safetensors in ``out``.

    ``config`` overrides GPT2Config fields; vocab_size defaults to the tokenizer's.
    ``prepare`` may change the randomised model before it is saved.
    """
    import torch
    from transformers import GPT2LMHeadModel

    eos = write_tokenizer(out, files)
    config.setdefault("vocab_size", eos + 1)
    cfg = gpt2_config(eos=eos, **config)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg).eval()
    randomise(model, seed, std)
    if prepare is not None:
        prepare(model)
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(out), **kwargs)
    return out


def load_hf_model(path: Path) -> Any:
    """The saved model back in transformers, eager attention (so attentions are returned)."""
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(str(path), attn_implementation="eager").eval()


STOP_PROMPT = "The module defines the following"


@dataclass(frozen=True)
class ServedGpt2:
    """The GPT-2 the export and service tests share, and where its greedy output stops."""

    hf_dir: Path
    stop_prompt: str  # greedy decoding of this prompt ends with <|endoftext|> ...
    eos_step: int  # ... as generated token number eos_step (0-based)


def build_served_gpt2(out: Path) -> ServedGpt2:
    """GPT-2's 12 layers × 12 heads at width 96 (head_dim 8, the least ONNX Runtime's
    GroupQueryAttention takes), vocab.json + merges.txt tokenizer."""
    from transformers import GPT2TokenizerFast

    steps: list[int] = []

    def prepare(model: Any) -> None:
        tok = GPT2TokenizerFast.from_pretrained(str(out))
        steps.append(route_to_eos(model, tok(STOP_PROMPT)["input_ids"], tok.eos_token_id))

    build_hf_model(out, "vocab+merges", seed=3, n_layer=12, n_head=12, n_embd=96,
                   prepare=prepare)
    return ServedGpt2(out, STOP_PROMPT, steps[0])
