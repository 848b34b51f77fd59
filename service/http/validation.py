"""From validated request bodies to engine requests: tokenize, truncate, check the limits.

Mirrors TGI's router validation: ``input_len ≤ max_input_tokens``, ``max_new_tokens ≤``
the server's bound and ``input_len + max_new_tokens ≤ max_total_tokens``, else 422. An
unset max_new_tokens takes the artifact's default, shortened to fit max_total_tokens
(``Validator.max_new_tokens``, the one place its sources are weighed).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from service.artifact.text import TextCodec
from service.contract import io_spec as io
from service.engine.grammar import Grammar, GrammarCompiler, GrammarError, GrammarKind
from service.engine.request import (
    ControlChoice,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
)
from service.settings import Limits, default_of


class InputError(ValueError):
    """A request the service refuses with 422; ``field`` names the offending input."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Validator:
    codec: TextCodec
    limits: Limits
    eos_token_id: int | None  # None: stop only at max_new_tokens or a stop sequence
    default_max_new_tokens: int | None  # config.json's (the export's); None: the contract's
    vocab_size: int = 0  # the model's logits width; 0: the tokenizer's
    extra_eos_ids: tuple[int, ...] = ()  # generation_config.json's eos_token_id list
    grammars: GrammarCompiler | None = None
    max_queued_requests: int = default_of("max_queued_requests")  # the setting's

    def check_token_id(self, token: int, field: str) -> None:
        """Token ids a client names (stop_token_ids, logit_bias, /detokenize) must exist."""
        vocab = self.vocab_size or self.codec.vocab_size
        if not 0 <= token < vocab:
            raise InputError(field, f"token id {token} is outside the vocabulary "
                                    f"(0..{vocab - 1})")

    def check_token_ids(self, ids: Iterable[int], field: str) -> None:
        for i, token in enumerate(ids):
            self.check_token_id(token, f"{field}.{i}")

    def grammar(self, kind: GrammarKind, value: str | dict[str, Any], field: str) -> Grammar:
        if self.grammars is None:
            raise InputError(field, "structured output is not available on this server")
        try:
            return self.grammars.compile(kind, value)
        except GrammarError as exc:
            raise InputError(field, str(exc)) from exc

    def tokenize(self, text: str, field: str, truncate: int | None = None,
                 add_special_tokens: bool = True) -> list[int]:
        if truncate is not None and truncate > self.limits.max_input_tokens:
            raise InputError("parameters.truncate", f"{truncate} exceeds max_input_tokens "
                                                    f"{self.limits.max_input_tokens}")
        ids = self.codec.encode(text, add_special_tokens)
        if not ids:
            raise InputError(field, "encodes to zero tokens")
        if truncate is not None:
            ids = ids[-truncate:]  # TGI keeps the last `truncate` tokens
        self.check_prompt_length(ids, field)
        return ids

    def prompt_ids(self, ids: list[int], field: str) -> list[int]:
        """A prompt the client gives as token ids (OpenAI's and vLLM's form): every id in
        the vocabulary, and no longer than a text prompt may encode to (the request schema
        refuses an empty list)."""
        self.check_prompt_length(ids, field)
        self.check_token_ids(ids, field)
        return list(ids)

    def check_prompt_length(self, ids: list[int], field: str) -> None:
        if len(ids) > self.limits.max_input_tokens:
            raise InputError(field, f"{len(ids)} tokens exceed max_input_tokens "
                                    f"{self.limits.max_input_tokens}")

    def check_count(self, count: int, field: str) -> None:
        """A list the queue can never hold is a client error (422), not overload (429)."""
        if count > self.max_queued_requests:
            raise InputError(field, f"{count} sequences in one request exceed "
                                    f"max_queued_requests {self.max_queued_requests}")

    def max_new_tokens(self, requested: int | None, prompt_tokens: int, field: str, *,
                       given: bool = True, author_default: int | None = None) -> int:
        """How many tokens a request may generate, its sources weighed here only. A length
        the client gives must fit the server's bound (``--max-new-tokens``) and what its
        prompt leaves of max_total_tokens, else 422. Without one, the model author's
        (generation_config.json: ``author_default``, which also replaces an API's own
        default length, ``given`` False), else the export's (config.json), else the
        contract's, shortened to fit both."""
        room = self.limits.max_total_tokens - prompt_tokens
        if requested is None or (not given and author_default is not None):
            default = (author_default or self.default_max_new_tokens
                       or io.DEFAULT_MAX_NEW_TOKENS)
            return max(1, min(default, room, self.limits.max_new_tokens))
        if requested > self.limits.max_new_tokens:
            raise InputError(field, f"{requested} exceeds the server's bound "
                                    f"max_new_tokens {self.limits.max_new_tokens}")
        if requested > room:
            raise InputError(
                field,
                f"inputs tokens + max_new_tokens must be <= {self.limits.max_total_tokens}; "
                f"given {prompt_tokens} input tokens and {requested} max_new_tokens")
        return requested

    def build(
        self, prompt_ids: list[int], sampling: SamplingParams, max_new_tokens: int | None,
        stop: list[str], max_new_field: str, prompt_logprobs: bool = False, *,
        stop_token_ids: tuple[int, ...] = (), ignore_eos: bool = False, min_tokens: int = 0,
        max_new_given: bool = True, author_max_new_tokens: int | None = None,
        token_logprobs: bool = True, adapter_name: str | None = None,
        control_vector: ControlChoice | None = None,
    ) -> GenerationRequest:
        """``max_new_given`` and ``author_max_new_tokens``: see ``max_new_tokens``."""
        max_new_tokens = self.max_new_tokens(max_new_tokens, len(prompt_ids), max_new_field,
                                             given=max_new_given,
                                             author_default=author_max_new_tokens)
        if min_tokens > max_new_tokens:
            raise InputError("min_tokens", f"{min_tokens} exceeds max_tokens {max_new_tokens}")
        eos = None if ignore_eos else self.eos_token_id
        eos_ids = () if eos is None else (eos, *self.extra_eos_ids)
        if min_tokens:  # vLLM: eos and stop_token_ids cannot end the text before min_tokens
            sampling = replace(sampling, min_tokens=min_tokens, suppress_ids=tuple(
                sorted({*stop_token_ids, *eos_ids})))
        return GenerationRequest(
            prompt_ids=prompt_ids, sampling=sampling,
            stopping=StoppingCriteria(
                max_new_tokens, tuple(stop), eos_token_id=eos, extra_eos_ids=self.extra_eos_ids,
                stop_token_ids=stop_token_ids, min_tokens=min_tokens),
            prompt_logprobs=prompt_logprobs, token_logprobs=token_logprobs,
            adapter_name=adapter_name, control_vector=control_vector)
