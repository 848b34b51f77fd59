"""Request bodies of the HTTP API; each owns its translation to engine parameters.

Models are strict (no "5" for 5) and forbid unknown fields, so a misspelt parameter is a
422 naming it rather than silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from service.contract.io_spec import ATTENTION_KINDS
from service.engine.request import SamplingParams

NonEmptyText = Annotated[str, Field(min_length=1)]
Seed = Annotated[int, Field(ge=0, lt=2**63)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class GenerateParameters(Strict):
    """TGI's parameters; temperature, top_k or top_p other than neutral turn sampling on."""

    max_new_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, gt=0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0, allow_inf_nan=False)
    do_sample: bool = False
    seed: Seed | None = None
    stop: list[NonEmptyText] = Field(default_factory=list, max_length=8)
    return_full_text: bool = False
    details: bool = False
    decoder_input_details: bool = False
    truncate: int | None = Field(None, ge=1)

    def to_sampling_params(self) -> SamplingParams:
        warped = ((self.temperature not in (None, 1.0)) or bool(self.top_k)
                  or (self.top_p not in (None, 1.0)))
        return SamplingParams(
            do_sample=self.do_sample or warped,
            temperature=self.temperature or 1.0,
            top_k=self.top_k or 0,
            top_p=self.top_p or 1.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            seed=self.seed,
        )


class GenerateRequest(Strict):
    inputs: NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1, max_length=64)]
    parameters: GenerateParameters = GenerateParameters.model_validate({})  # never mutated
    stream: Literal[False] = False  # TGI clients send it; streaming is /generate_stream


class StreamRequest(Strict):
    inputs: NonEmptyText
    parameters: GenerateParameters = GenerateParameters.model_validate({})
    stream: Literal[True] = True


class StreamOptions(Strict):
    include_usage: bool = False


class CompletionRequest(Strict):
    """OpenAI /v1/completions (the fields the service honours; others are refused)."""

    model: str
    prompt: NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1, max_length=64)]
    max_tokens: int | None = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    n: int = Field(1, ge=1, le=8)
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=4)] | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    user: str | None = None
    # Accepted at their neutral values only (the openai client may send them).
    presence_penalty: float = Field(0.0, ge=0, le=0)
    frequency_penalty: float = Field(0.0, ge=0, le=0)
    best_of: int | None = Field(None, ge=1, le=1)

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(
            do_sample=self.temperature > 0,
            temperature=self.temperature if self.temperature > 0 else 1.0,
            top_p=self.top_p,
            seed=self.seed,
            top_n_logprobs=self.logprobs or 0,
        )

    @property
    def stop_sequences(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


AttentionKindName = Literal["q", "k", "v", "scores", "scaled_scores", "weights"]
assert set(AttentionKindName.__args__) == set(ATTENTION_KINDS)  # type: ignore[attr-defined]


def _weights_only() -> list[AttentionKindName]:
    return ["weights"]


class AttentionRequest(Strict):
    inputs: NonEmptyText
    layers: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1)
    heads: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1)
    include: list[AttentionKindName] = Field(default_factory=_weights_only, min_length=1)
    format: Literal["json", "npz", "png", "bertviz"] = "json"
