"""What a request asks of the engine, and what the engine sends back, token by token."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

FinishReason = Literal["length", "eos_token", "stop_sequence"]

if TYPE_CHECKING:
    import numpy as np

_ids = itertools.count(1)


class TokenConstraint(Protocol):
    """A per-sequence grammar state (service/engine/grammar.py): which tokens may come next."""

    def allowed(self) -> np.ndarray:  # (V,) bool
        ...

    def consume(self, token_id: int) -> None: ...


class ConstraintFactory(Protocol):
    """Makes a fresh constraint for each sequence (the n choices of a request each get one)."""

    def new(self) -> TokenConstraint: ...


@dataclass(frozen=True)
class SamplingParams:
    """Per-request next-token choice; several of these live side by side in one batch.

    Logits are processed in this order (vLLM's and TGI's): grammar mask, logit_bias,
    min_tokens mask, repetition penalty, presence and frequency penalties; then, when
    sampling, temperature, top-k, top-p, typical-p and min-p.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filtering
    top_p: float = 1.0
    typical_p: float = 1.0  # 1: off (TGI / transformers' TypicalLogitsWarper)
    min_p: float = 0.0  # 0: off; keep tokens with p >= min_p * max p
    repetition_penalty: float = 1.0  # prompt and output tokens (CTRL / TGI)
    presence_penalty: float = 0.0  # output tokens only (OpenAI / vLLM)
    frequency_penalty: float = 0.0  # output tokens only, per occurrence
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_tokens: int = 0  # suppress_ids are masked until this many tokens are generated
    suppress_ids: tuple[int, ...] = ()  # eos and stop_token_ids, for min_tokens
    seed: int | None = None  # None with do_sample: the engine picks one and reports it
    top_n_logprobs: int = 0  # alternatives reported per token (OpenAI logprobs, TGI top_n_tokens)
    constraint: ConstraintFactory | None = None  # structured output (a grammar)

    @classmethod
    def of_request(cls, *, do_sample: bool, temperature: float | None = None,
                   top_k: int | None = None, top_p: float | None = None,
                   typical_p: float | None = None, **rest: Any) -> SamplingParams:
        """A request's choice of token, the one reading of it both APIs share: it samples
        when asked (``do_sample``: OpenAI always asks, TGI's flag) or when a warper is
        other than neutral (TGI's rule), except at temperature 0, which is greedy (OpenAI's;
        TGI refuses 0). None, 0 (and top_k -1, OpenAI's off) are each warper's neutral
        value; ``rest``, the other fields, go in as given."""
        warped = (temperature not in (None, 1.0) or bool(top_k and top_k > 0)
                  or top_p not in (None, 1.0) or typical_p not in (None, 1.0))
        return cls(do_sample=(do_sample or warped) and temperature != 0,
                   temperature=temperature or 1.0, top_k=max(top_k or 0, 0),
                   top_p=top_p or 1.0, typical_p=typical_p or 1.0, **rest)

    @property
    def is_plain_sampling(self) -> bool:
        """Sampling with temperature, top-k and top-p alone on the raw logits: what a
        sampler on the GPU computes (service/engine/cuda.py)."""
        return (self.do_sample and self.typical_p == 1.0 and self.min_p == 0.0
                and self.repetition_penalty == 1.0 and self.presence_penalty == 0.0
                and self.frequency_penalty == 0.0 and not self.logit_bias
                and self.min_tokens == 0 and self.constraint is None)

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy on the raw logits: the whole batch's argmax is the answer for this row."""
        return (not self.do_sample and self.repetition_penalty == 1.0
                and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0
                and not self.logit_bias and self.min_tokens == 0 and self.constraint is None)


@dataclass(frozen=True)
class StoppingCriteria:
    max_new_tokens: int
    stop_sequences: tuple[str, ...] = ()
    eos_token_id: int | None = None  # None: ignore_eos
    extra_eos_ids: tuple[int, ...] = ()  # generation_config.json's other end tokens
    stop_token_ids: tuple[int, ...] = ()  # end the sequence, left out of the text (vLLM)
    min_tokens: int = 0  # no stop sequence ends the sequence before this many tokens


@dataclass(frozen=True)
class AdapterRef:
    """The LoRA adapter a request runs under: its name and the id its weights were loaded
    as (service/engine/adapters.py; never reused, so an adapter loaded again under the
    same name is another)."""

    name: str
    id: int


@dataclass(frozen=True)
class ControlChoice:
    """The control vector a request asks for: a served one's name, the scale its directions
    are multiplied by, and the layers it steers (inclusive, as llama.cpp's
    ``--control-vector-layer-range``; None: all)."""

    name: str
    scale: float = 1.0
    layers: tuple[int, int] | None = None


@dataclass(frozen=True)
class Steering:
    """A control vector a row runs under: the choice, with the id its directions were
    loaded as (service/engine/control_vectors.py; never reused, so a vector loaded again
    under the same name is another) and the directions themselves, (n_layers, d), which
    the row keeps while it runs even if the vector is unloaded meanwhile (not compared:
    the id says which they are)."""

    name: str
    id: int
    scale: float = 1.0
    layers: tuple[int, int] | None = None
    directions: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class ModelVariant:
    """What computes a row besides the base weights: its LoRA adapter, by id (0: none), and
    its control vector with its scale and layers (None: none). A row carries it
    (step_plan.RowWork) and the prefix cache keys blocks by it, so keys and values computed
    under one variant never serve another; a new per-row input that changes them is a
    field here."""

    adapter: int = 0
    steering: Steering | None = None


BASE = ModelVariant()


@dataclass
class GenerationRequest:
    """A tokenized, validated request; ``cancelled`` is set from the event loop."""

    prompt_ids: list[int]
    sampling: SamplingParams
    stopping: StoppingCriteria
    prompt_logprobs: bool = False  # TGI decoder_input_details
    # Each generated token's log-probability is reported (TGI's stream and details, OpenAI
    # logprobs). False skips a pass over the vocabulary per row and step.
    token_logprobs: bool = True
    id: int = field(default_factory=lambda: next(_ids))
    arrival: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    adapter_name: str | None = None  # the LoRA adapter asked for (None: the base model)
    adapter: AdapterRef | None = None  # it, resolved when the engine takes the request
    control_vector: ControlChoice | None = None  # the control vector asked for (None: none)
    steering: Steering | None = None  # it, resolved when the engine takes the request

    @property
    def variant(self) -> ModelVariant:
        """What its rows are computed under (its adapter and control vector once resolved)."""
        if self.adapter is None and self.steering is None:
            return BASE
        return ModelVariant(adapter=0 if self.adapter is None else self.adapter.id,
                            steering=self.steering)

    @property
    def reserved_tokens(self) -> int:
        """KV-cache tokens this request may hold at most: what admission budgets for."""
        return len(self.prompt_ids) + self.stopping.max_new_tokens


@dataclass(frozen=True)
class TokenInfo:
    id: int
    text: str
    logprob: float | None
    special: bool = False
    top: tuple[tuple[int, str, float], ...] = ()  # (id, text, logprob) alternatives


@dataclass(frozen=True)
class FinishInfo:
    reason: FinishReason
    generated_text: str  # special tokens skipped; ends right after a matched stop sequence
    generated_tokens: int
    seed: int | None
    stop_sequence: str | None
    stop_offset: int | None  # index in generated_text where the matched stop sequence starts
    prefill: tuple[TokenInfo, ...]  # prompt tokens with logprobs when prompt_logprobs
    queue_time: float  # seconds from arrival to the start of prefill
    inference_time: float  # seconds from the start of prefill to the last token


@dataclass(frozen=True)
class TokenEvent:
    token: TokenInfo
    index: int  # 0-based position among the generated tokens
    finish: FinishInfo | None = None  # set on the last token


@dataclass(frozen=True)
class ErrorEvent:
    message: str
    kind: Literal["generation", "shutdown"] = "generation"


Event = TokenEvent | ErrorEvent
