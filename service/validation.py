"""From validated request bodies to engine requests: tokenize, truncate, check the limits.

Mirrors TGI's router validation: ``input_len ≤ max_input_tokens``, ``max_new_tokens ≤``
the server's bound and ``input_len + max_new_tokens ≤ max_total_tokens``, else 422. An
unset max_new_tokens takes the artifact's default, shortened to fit max_total_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.engine.request import GenerationRequest, SamplingParams, StoppingCriteria
from service.engine.text import TextCodec
from service.settings import Limits


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
    default_max_new_tokens: int

    def tokenize(self, text: str, field: str, truncate: int | None = None) -> list[int]:
        ids = self.codec.encode(text)
        if not ids:
            raise InputError(field, "encodes to zero tokens")
        if truncate is not None:
            ids = ids[-truncate:]  # TGI keeps the last `truncate` tokens
        if len(ids) > self.limits.max_input_tokens:
            raise InputError(field, f"{len(ids)} tokens exceed max_input_tokens "
                                    f"{self.limits.max_input_tokens}")
        return ids

    def check_count(self, count: int, field: str) -> None:
        """A list the queue can never hold is a client error (422), not overload (429)."""
        if count > self.limits.max_queued_requests:
            raise InputError(field, f"{count} sequences in one request exceed "
                                    f"max_queued_requests {self.limits.max_queued_requests}")

    def build(
        self, prompt_ids: list[int], sampling: SamplingParams, max_new_tokens: int | None,
        stop: list[str], max_new_field: str, prompt_logprobs: bool = False,
    ) -> GenerationRequest:
        room = self.limits.max_total_tokens - len(prompt_ids)
        if max_new_tokens is None:
            max_new_tokens = max(1, min(self.default_max_new_tokens, room,
                                        self.limits.max_new_tokens))
        if max_new_tokens > self.limits.max_new_tokens:
            raise InputError(max_new_field, f"{max_new_tokens} exceeds the server's bound "
                                            f"max_new_tokens {self.limits.max_new_tokens}")
        if max_new_tokens > room:
            raise InputError(
                max_new_field,
                f"inputs tokens + max_new_tokens must be <= {self.limits.max_total_tokens}; "
                f"given {len(prompt_ids)} input tokens and {max_new_tokens} max_new_tokens")
        return GenerationRequest(
            prompt_ids=prompt_ids, sampling=sampling,
            stopping=StoppingCriteria(max_new_tokens, tuple(stop), self.eos_token_id),
            prompt_logprobs=prompt_logprobs)
