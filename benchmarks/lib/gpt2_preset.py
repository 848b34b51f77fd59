"""The ``gpt2`` preset: GPT-2 small (124 M parameters) with random weights, no download.

transformers builds ``GPT2LMHeadModel(GPT2Config())`` (its own initialisation, seed 0)
and saves it as a Hugging Face directory; ``attnserve import`` turns that directory into
our checkpoint, and every peer (transformers, CTranslate2, llama.cpp's GGUF) converts the
same directory, so all engines run the same weights.

GPT-2's own tokenizer cannot be fetched, and the engines are fed token ids, so a
byte-level BPE is trained on the stdlib corpus (about 12 k tokens: all that corpus
yields) and its vocabulary is filled up to GPT-2's 50,257 ids with unreachable
``<|unusedN|>`` entries, ``<|endoftext|>`` last (50256, bos = eos, no pad), exactly
GPT-2's layout, so every converter sees a 50,257-token vocabulary.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

PRESET = "gpt2"
ENDOFTEXT = "<|endoftext|>"
SEED = 0


def _trained_vocab(vocab_size: int) -> tuple[dict[str, int], str]:
    """vocab.json (as a dict) and merges.txt of a byte-level BPE on the stdlib corpus."""
    from tokenizers import ByteLevelBPETokenizer

    from model.data import read_documents, stdlib_corpus_path

    text = "\n\n".join(read_documents(stdlib_corpus_path()))
    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator([text[i:i + 4000] for i in range(0, len(text), 4000)],
                            vocab_size=vocab_size, show_progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        bpe.save_model(tmp)
        vocab = json.loads((Path(tmp) / "vocab.json").read_text("utf-8"))
        return vocab, (Path(tmp) / "merges.txt").read_text("utf-8")


def write_tokenizer(out: Path, vocab_size: int, model_max_length: int = 1024) -> int:
    """GPT-2-layout tokenizer files in ``out`` (vocab.json, merges.txt, tokenizer.json and
    the two config files GPT2Tokenizer reads); returns the eos id (vocab_size - 1)."""
    from tokenizers import AddedToken, ByteLevelBPETokenizer

    vocab, merges = _trained_vocab(vocab_size - 1)
    learned = len(vocab)
    for i in range(learned, vocab_size - 1):  # never produced: no merge leads to them
        vocab[f"<|unused{i}|>"] = i
    eos = vocab_size - 1
    out.mkdir(parents=True, exist_ok=True)
    (out / "merges.txt").write_text(merges, "utf-8")
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), "utf-8")
    bpe = ByteLevelBPETokenizer.from_file(str(out / "vocab.json"), str(out / "merges.txt"))
    bpe.add_special_tokens([AddedToken(ENDOFTEXT, special=True, normalized=False)])
    if bpe.token_to_id(ENDOFTEXT) != eos:
        raise RuntimeError(f"{ENDOFTEXT} landed on id {bpe.token_to_id(ENDOFTEXT)}, not {eos}")
    bpe.save(str(out / "tokenizer.json"))
    vocab[ENDOFTEXT] = eos
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), "utf-8")
    special = {"bos_token": ENDOFTEXT, "eos_token": ENDOFTEXT, "unk_token": ENDOFTEXT}
    (out / "special_tokens_map.json").write_text(json.dumps(special), "utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(
        {**special, "tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False,
         "model_max_length": model_max_length}), "utf-8")
    return eos


def learned_token_count(hf_dir: Path) -> int:
    """Entries of vocab.json that the BPE learned (not the ``<|unusedN|>`` filler)."""
    vocab = json.loads((hf_dir / "vocab.json").read_text("utf-8"))
    return sum(not k.startswith("<|unused") for k in vocab)


def build_hf_gpt2(out: Path, seed: int = SEED) -> dict[str, int]:
    """Random-weight GPT-2 small as a Hugging Face directory (safetensors); its sizes."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config()  # 124 M: 12 layers, 12 heads, d 768, 1024 positions, 50,257 ids
    eos = write_tokenizer(out, config.vocab_size)
    config.bos_token_id = config.eos_token_id = eos
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    return {"params": int(model.num_parameters()), "vocab_size": config.vocab_size,
            "learned_tokens": learned_token_count(out), "eos_token_id": eos}


def import_built(work: Path, name: str, build: Callable[[Path], dict[str, int]],
                 model: str) -> tuple[Path, Path, str]:
    """Build a Hugging Face directory ``work/name`` with ``build``, import it with
    ``attnserve import``; (checkpoint, HF directory, the weights' description)."""
    from model.hf_import import import_hf_checkpoint

    hf = work / name
    sizes = build(hf)
    ckpt = import_hf_checkpoint(hf, work / "ckpt", force=True)
    return ckpt, hf, (f"random init ({model}, seed {SEED}); tokenizer: byte-level BPE "
                      f"trained on the stdlib corpus, {sizes['learned_tokens']} learned tokens "
                      f"in a {sizes['vocab_size']}-id vocabulary, <|endoftext|> = "
                      f"{sizes['eos_token_id']}")


def prepare_gpt2(work: Path) -> tuple[Path, Path, str]:
    """(checkpoint, HF directory, description) for the gpt2 preset, built under ``work``."""
    return import_built(work, "hf-gpt2", build_hf_gpt2,
                        "transformers GPT2LMHeadModel(GPT2Config())")
