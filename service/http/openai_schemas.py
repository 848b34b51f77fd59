"""Request bodies of the OpenAI-compatible routes: /v1/completions and /v1/chat/completions.

Both share the sampling fields OpenAI defines plus vLLM's extra ones (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``). Bounds are
declared here, so the OpenAPI document states exactly what the server accepts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

from pydantic import ConfigDict, Field

from service.http.schemas import ControlVectorChoice, Integral, NonEmptyText, Seed, Strict

TokenId = Annotated[int, Field(ge=0, lt=2**31), Integral]
PromptIds = Annotated[list[TokenId], Field(min_length=1)]  # checked against the vocabulary
Bias = Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]
MAX_BIAS_ENTRIES = 300  # OpenAI's own cap on logit_bias
MAX_STOP_TOKEN_IDS = 64


class StreamOptions(Strict):
    include_usage: bool = False


class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]


class JsonSchemaSpec(Strict):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat,
                           Field(discriminator="type")]


class OpenAISampling(Strict):
    """Fields common to completions and chat completions."""

    model: str
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    n: Annotated[int, Field(ge=1, le=8), Integral] = 1
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=4)] | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    logit_bias: Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")], Bias],
                          Field(max_length=MAX_BIAS_ENTRIES)] | None = Field(
        None, description="token id (as a string) → bias added to its logit, -100..100")
    response_format: ResponseFormat | None = None
    # vLLM's extra sampling parameters
    top_k: Annotated[int, Field(ge=-1, description="0 or -1: off"), Integral] = 0
    min_p: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0, le=10, allow_inf_nan=False)
    min_tokens: Annotated[int, Field(ge=0), Integral] = 0
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    # ours: steer with a served control vector (GET /info lists them)
    control_vector: ControlVectorChoice | None = None

    @property
    def stop_sequences(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(OpenAISampling):
    """OpenAI /v1/completions (the fields the service honours; others are refused).

    ``prompt`` is text, a list of texts, token ids, or a list of token-id lists (OpenAI's
    and vLLM's four forms: lm-evaluation-harness sends token ids by default).
    ``max_tokens`` 0 with ``echo`` scores the prompt without generating (vLLM's)."""

    prompt: (NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1, max_length=64)]
             | PromptIds | Annotated[list[PromptIds], Field(min_length=1, max_length=64)])
    max_tokens: Annotated[int, Field(ge=0), Integral] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=5), Integral] | None = None
    echo: bool = False
    # accepted at its neutral value only
    best_of: Annotated[int, Field(ge=1, le=1), Integral] | None = None

    @property
    def single_prompt(self) -> bool:
        """The prompt is one text or one list of token ids (its field is ``prompt``)."""
        return isinstance(self.prompt, str) or isinstance(self.prompt[0], int)

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: its text or its token ids."""
        if self.single_prompt:
            return [cast(str | list[int], self.prompt)]
        return list(cast(list[str] | list[list[int]], self.prompt))

    @property
    def scores_only(self) -> bool:
        """``max_tokens`` 0 with ``echo``: the prompt's logprobs, nothing generated."""
        return self.echo and self.max_tokens == 0

    @property
    def top_n_logprobs(self) -> int:
        return self.logprobs or 0


class TextPart(Strict):
    type: Literal["text"]
    text: str


Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(Strict):
    role: Role
    content: str | Annotated[list[TextPart], Field(min_length=1)]
    name: str | None = None
    tool_call_id: str | None = None

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: content a string (text parts joined by
        newlines, as vLLM does for text-only models)."""
        content = (self.content if isinstance(self.content, str)
                   else "\n".join(p.text for p in self.content))
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


Messages = Annotated[list[ChatMessage], Field(min_length=1, max_length=256)]


class ChatCompletionRequest(OpenAISampling):
    """OpenAI /v1/chat/completions: messages rendered with the model's chat template."""

    messages: Messages
    max_tokens: Annotated[int, Field(ge=1), Integral] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1), Integral] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20), Integral] | None = None
    add_generation_prompt: bool = True  # vLLM extra
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extra: more template variables

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def top_n_logprobs(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0


class ChatTokenizeRequest(Strict):
    """vLLM's /tokenize body for a conversation: the tokens of the rendered template."""

    model: str | None = None
    messages: Messages
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
