"""Structured output: token masks from llguidance, one matcher per sequence.

llguidance (Rust, the library vLLM, SGLang and llama.cpp use) compiles a JSON schema, a
regular expression or a Lark grammar against the tokenizer once, then answers "which
tokens may come next" in microseconds per step. A constrained row of the batch masks its
logits with that answer; free rows beside it are untouched. Once the grammar is complete
the mask allows only the end-of-sequence token, so generation ends there.

JSON is compiled without free whitespace between tokens (``whitespace_flexible`` off, as
in OpenAI's structured outputs): a small model could otherwise emit blanks until
max_tokens and never close the document.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import llguidance
import llguidance.numpy as llnp
import numpy as np

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stub only

GrammarKind = Literal["json_schema", "regex", "lark"]
JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """The schema, pattern or grammar cannot be compiled; the message says why."""


class GrammarCompiler:
    """Turns a schema or pattern into a ``Grammar``. The tokenizer table (a walk over the
    whole vocabulary, about a second for 128k tokens) is built once, at start-up, by
    ``tokenizer()`` from the loader thread."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int) -> None:
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos = eos_token_id
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self._vocab_size, eos_token=self._eos)
            return self._tokenizer

    def compile(self, kind: GrammarKind, value: str | dict[str, Any]) -> Grammar:
        """A validated grammar, or GrammarError."""
        try:
            if kind == "json_schema":
                schema = value if isinstance(value, dict) else json.loads(value)
                text = llguidance.LLMatcher.grammar_from_json_schema(schema,
                                                                     defaults=JSON_DEFAULTS)
            elif kind == "regex":
                text = llguidance.LLMatcher.grammar_from_regex(str(value))
            else:
                text = llguidance.LLMatcher.grammar_from_lark(str(value))
        except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
            raise GrammarError(f"not a valid {kind.replace('_', ' ')}: {exc}") from exc
        matcher = llguidance.LLMatcher(self.tokenizer(), text, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {kind.replace('_', ' ')}: {matcher.get_error()}")
        return Grammar(matcher, self._vocab_size, self._eos)


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar, compiled once when the request is validated; each sequence that
    follows it gets a copy of the fresh matcher (``new``: cheap, so the engine thread never
    compiles)."""

    prototype: llguidance.LLMatcher  # never advanced
    vocab_size: int
    eos_token_id: int

    def new(self) -> GrammarState:
        return GrammarState(self.prototype.deep_copy(), self.vocab_size, self.eos_token_id)


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_id: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._bitmask = llnp.allocate_token_bitmask(1, vocab_size)  # (1, ceil(V / 32)) int32

    def allowed(self) -> np.ndarray:
        """(V,) bool: the tokens the grammar accepts next (only end-of-sequence once done)."""
        if self.matcher.is_stopped() or self.matcher.is_error():
            only_eos = np.zeros(self.vocab_size, dtype=bool)
            only_eos[self.eos_token_id] = True
            return only_eos
        llnp.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")  # (32 * words,)
        return bits[:self.vocab_size].astype(bool)

    def consume(self, token_id: int) -> None:
        self.matcher.consume_token(token_id)
