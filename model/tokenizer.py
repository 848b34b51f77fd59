"""Tokenizers built with the `tokenizers` library and saved as a standard tokenizer.json.

Two kinds:
- ``char``: one token per Unicode character (the seeds' 你/好/世/界 vocabulary), with an
  ``<unk>`` token for characters never seen in training.
- ``bpe``: byte-level BPE (GPT-2 style), so any UTF-8 text round-trips, emoji included.

Both reserve the same special tokens at the same ids: ``<pad>`` 0, ``<start>`` 1 and
``<end>`` 2 (seed 004's decoder start and stop markers). Prompts are encoded without
special tokens; training separates documents with ``<end>``, which also stops generation.
Imported tokenizers keep their own special tokens (GPT-2: ``<|endoftext|>`` 50256 is both
bos and eos, and there is no pad token), so a checkpoint's config.json declares its ids
and ``checkpoint_special_ids`` checks them against the tokenizer instead of assuming 0/1/2.
The module imports no torch, so the service can use the same helpers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

TokenizerKind = Literal["char", "bpe"]

PAD, BOS, EOS, UNK = "<pad>", "<start>", "<end>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS)  # ids 0, 1, 2 in both kinds
DEFAULT_BPE_VOCAB = 4096


SPECIAL_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id")


@dataclass(frozen=True)
class SpecialIds:
    """Special token ids; None where the tokenizer has no such token (GPT-2 has no pad)."""

    pad_token_id: int | None
    bos_token_id: int | None
    eos_token_id: int | None

    def to_dict(self) -> dict[str, int | None]:
        return {"pad_token_id": self.pad_token_id, "bos_token_id": self.bos_token_id,
                "eos_token_id": self.eos_token_id}


def special_ids(tokenizer: Tokenizer) -> SpecialIds:
    """The ids of our own tokenizers' ``<pad>``, ``<start>`` and ``<end>``."""
    ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
    if any(i is None for i in ids):
        raise ValueError(f"tokenizer lacks the special tokens {SPECIAL_TOKENS}")
    pad, bos, eos = (int(i) for i in ids if i is not None)
    return SpecialIds(pad, bos, eos)


def checkpoint_special_ids(tokenizer: Tokenizer, declared: Mapping[str, object]) -> SpecialIds:
    """The special ids a checkpoint's config.json declares, checked against its tokenizer.

    A declared id must name a token the tokenizer has; None means "no such token". A
    config that declares none of them (older checkpoints) gets our own tokens by name.
    """
    if not any(k in declared for k in SPECIAL_KEYS):
        return special_ids(tokenizer)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    ids: dict[str, int | None] = {}
    for key in SPECIAL_KEYS:
        value = declared.get(key)
        if value is None:
            ids[key] = None
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size \
                or tokenizer.id_to_token(value) is None:
            raise ValueError(f"{key} {value!r} is not a token of the tokenizer "
                             f"({size} tokens)")
        ids[key] = value
    return SpecialIds(ids["pad_token_id"], ids["bos_token_id"], ids["eos_token_id"])


def build_char_tokenizer(texts: Iterable[str], extra_chars: str = "") -> Tokenizer:
    """One token per distinct character, in order of first appearance after the specials."""
    vocab: dict[str, int] = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, UNK))}
    for text in (*texts, extra_chars):
        for ch in text:
            if ch not in vocab:
                vocab[ch] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # [\s\S] matches any character, newline included: each becomes a token of its own.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([*SPECIAL_TOKENS, UNK])
    return tokenizer


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_BPE_VOCAB) -> Tokenizer:
    """Byte-level BPE trained on ``texts``; the 256 byte symbols are always in the vocabulary."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"BPE vocab_size must be at least {256 + len(SPECIAL_TOKENS)}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def build_tokenizer(kind: TokenizerKind, texts: list[str],
                    vocab_size: int = DEFAULT_BPE_VOCAB) -> Tokenizer:
    if kind == "char":
        return build_char_tokenizer(texts)
    if kind == "bpe":
        return train_bpe_tokenizer(texts, vocab_size)
    raise ValueError(f"unknown tokenizer kind {kind!r}; choose 'char' or 'bpe'")


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def decode(tokenizer: Tokenizer, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    return str(tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))
