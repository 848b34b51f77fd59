"""Tokenizer access for the service, straight from tokenizer.json (no model/ import).

``IncrementalDecoder`` turns generated ids into text pieces as they arrive. A byte-level
BPE token may hold part of a UTF-8 character, so a piece is released only once the text
decodes without a replacement character (the method TGI uses); the pieces of one
sequence always concatenate to its final text.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"


class TextCodec:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        self.special_ids = frozenset(
            i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special)

    @classmethod
    def from_file(cls, path: str | Path) -> TextCodec:
        return cls(Tokenizer.from_file(str(path)))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of ``text`` as transformers' ``tokenizer(text)`` gives them: with whatever
        the tokenizer's post-processor adds (TinyLlama's ``<s>``; nothing for GPT-2, SmolLM2,
        Qwen2.5 or ours), as TGI and vLLM do for raw prompts. A rendered chat template
        already holds its special tokens: encode it with ``add_special_tokens=False``."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def token_text(self, token_id: int) -> str:
        """Readable text of one token on its own (prompt pieces, alternatives, labels)."""
        if token_id in self.special_ids:
            return self.tokenizer.id_to_token(token_id) or ""
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    def decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder(self)


class IncrementalDecoder:
    """Text pieces for one sequence's generated ids; special tokens contribute none."""

    def __init__(self, codec: TextCodec) -> None:
        self._codec = codec
        self._ids: list[int] = []
        self._prefix = 0  # start of the window decoded for context
        self._read = 0  # ids before this index have been released as text
        self.text = ""  # everything released so far

    def push(self, token_id: int) -> str:
        if token_id in self._codec.special_ids:
            return ""
        self._ids.append(token_id)
        window = self._ids[self._prefix:]
        before = self._codec.decode(self._ids[self._prefix:self._read])
        after = self._codec.decode(window)
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            piece = after[len(before):]
            self._prefix, self._read = self._read, len(self._ids)
            self.text += piece
            return piece
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        full = self._codec.decode(self._ids)
        rest = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += rest
        return rest
