"""Request bodies of the HTTP API; each owns its translation to engine parameters.

Models are strict (no "5" for 5) and forbid unknown fields, so a misspelt parameter is a
422 naming it rather than silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from service.contract.io_spec import ATTENTION_KINDS
from service.contract.lens_spec import INPUT_DEFAULTS, MAX_TOP_K, TOP_K
from service.viz.look_inside import MEMBERS as LOOK_INSIDE


def _integral(value: Any) -> Any:
    """JSON Schema counts 3.0 as an integer; so do we (strict mode alone would not)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _bool_only(value: Any) -> Any:
    """A Literal[False] alone would take 0 (0 == False); only JSON booleans pass here."""
    if not isinstance(value, bool):
        raise ValueError("Input should be a valid boolean")
    return value


Integral = BeforeValidator(_integral)  # after the constraints, so they reach the schema
NonEmptyText = Annotated[str, Field(min_length=1)]
# Seeds stay below 2**53: every JSON client reads and writes them exactly (a double).
SEED_BOUND = 2**53
Seed = Annotated[int, Field(ge=0, lt=SEED_BOUND), Integral]
MAX_TOP_N_TOKENS = 5  # TGI's default --max-top-n-tokens
MAX_LENS_TOP_K, DEFAULT_LENS_TOP_K = MAX_TOP_K, INPUT_DEFAULTS[TOP_K]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class JsonGrammar(Strict):
    type: Literal["json"]
    value: dict[str, Any] | str = Field(description="a JSON schema (object or string)")


class RegexGrammar(Strict):
    type: Literal["regex"]
    value: NonEmptyText


Grammar = Annotated[JsonGrammar | RegexGrammar, Field(discriminator="type")]


class ControlVectorChoice(Strict):
    """A served control vector and its scale (docs/steering.md), and optionally the layers
    it steers (inclusive, llama.cpp's --control-vector-layer-range)."""

    name: NonEmptyText
    scale: float = Field(1.0, allow_inf_nan=False, description="the directions are "
                         "multiplied by it; |scale| at most --max-control-scale")
    layers: Annotated[list[Annotated[int, Field(ge=1), Integral]],
                      Field(min_length=2, max_length=2)] | None = Field(
        None, description="[first, last] layer steered (absent: every layer)")


class GenerateParameters(Strict):
    """TGI's parameters; temperature, top_k, top_p or typical_p other than neutral turn
    sampling on."""

    max_new_tokens: Annotated[int, Field(ge=1), Integral] | None = None
    temperature: float | None = Field(None, gt=0, allow_inf_nan=False)
    top_k: Annotated[int, Field(ge=0), Integral] | None = None
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    typical_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    do_sample: bool = False
    seed: Seed | None = None
    stop: list[NonEmptyText] = Field(default_factory=list, max_length=8)
    return_full_text: bool = False
    details: bool = False
    decoder_input_details: bool = False
    truncate: Annotated[int, Field(ge=1), Integral] | None = None
    top_n_tokens: Annotated[int, Field(ge=0, le=MAX_TOP_N_TOKENS), Integral] | None = None
    grammar: Grammar | None = None
    adapter_id: NonEmptyText | None = Field(
        None, description="a LoRA adapter the server serves (GET /v1/models lists them); "
                          "absent: the base model")
    control_vector: ControlVectorChoice | None = Field(
        None, description="steer with a served control vector (GET /info lists them)")
    # Sent by TGI's own client; accepted at their neutral values only.
    best_of: Annotated[int, Field(ge=1, le=1), Integral] | None = None
    watermark: Annotated[Literal[False], BeforeValidator(_bool_only)] = False


class GenerateRequest(Strict):
    inputs: NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1, max_length=64)]
    parameters: GenerateParameters = GenerateParameters.model_validate({})  # never mutated
    # TGI clients send it; streaming is /generate_stream
    stream: Annotated[Literal[False], BeforeValidator(_bool_only)] = False


class CompatRequest(Strict):
    """TGI's POST /: /generate or /generate_stream, chosen by ``stream``."""

    inputs: NonEmptyText
    parameters: GenerateParameters = GenerateParameters.model_validate({})
    stream: bool = False


class StreamRequest(Strict):
    inputs: NonEmptyText
    parameters: GenerateParameters = GenerateParameters.model_validate({})
    stream: Annotated[Literal[True], BeforeValidator(_bool_only)] = True


AttentionKindName = Literal["q", "k", "v", "scores", "scaled_scores", "weights"]
assert set(AttentionKindName.__args__) == set(ATTENTION_KINDS)  # type: ignore[attr-defined]


# what the residual stream says (service/viz/look_inside.py), beside the attention maps
LookInsideName = Literal["logit_lens", "head_attribution", "residual_norms"]
assert set(LookInsideName.__args__) == set(LOOK_INSIDE)  # type: ignore[attr-defined]


def _weights_only() -> list[AttentionKindName | LookInsideName]:
    return ["weights"]


class AttentionRequest(Strict):
    inputs: NonEmptyText
    layers: list[Annotated[int, Field(ge=0), Integral]] | None = Field(None, min_length=1)
    heads: list[Annotated[int, Field(ge=0), Integral]] | None = Field(None, min_length=1)
    include: list[AttentionKindName | LookInsideName] = Field(
        default_factory=_weights_only, min_length=1)
    top_k: Annotated[int, Field(ge=1, le=MAX_LENS_TOP_K), Integral] = Field(
        DEFAULT_LENS_TOP_K, description="logit_lens: the tokens shown per layer and position")
    target: Annotated[int, Field(ge=0), Integral] | None = Field(
        None, description="a token id: its probability and rank in logit_lens, the token "
                          "head_attribution explains (absent: the model's own next token)")
    position: Annotated[int, Field(ge=0), Integral] | None = Field(
        None, description="head_attribution's token position (absent: the last)")
    format: Literal["json", "npz", "png", "bertviz"] = "json"
    adapter_id: NonEmptyText | None = Field(
        None, description="the attention of the model under this LoRA adapter (501 where "
                          "the attention model applies none yet); absent: the base model")
    control_vector: ControlVectorChoice | None = Field(
        None, description="the attention of the model steered by a served control vector "
                          "(GET /info lists them), as /generate's parameters.control_vector")


class TgiTokenizeRequest(Strict):
    """TGI's /tokenize body."""

    inputs: NonEmptyText
    # TGI clients may send it; only adapter_id is looked at (a served adapter, else 404:
    # every adapter shares the base's tokenizer)
    parameters: dict[str, Any] | None = None


class PromptTokenizeRequest(Strict):
    """vLLM's /tokenize body for a completion prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, lt=2**31), Integral]] = Field(max_length=1 << 16)


class LoadLoraAdapterRequest(Strict):
    """vLLM's POST /v1/load_lora_adapter body."""

    lora_name: NonEmptyText = Field(description="the name requests will give as `model` "
                                                "(OpenAI) or `adapter_id` (TGI)")
    lora_path: NonEmptyText = Field(description="a PEFT LoRA adapter directory under the "
                                                "server's lora_dir (relative: to it)")


class UnloadLoraAdapterRequest(Strict):
    """vLLM's POST /v1/unload_lora_adapter body."""

    lora_name: NonEmptyText
