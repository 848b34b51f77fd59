"""OpenAI's two generation routes (completions and chat) on the engine: the request fields
turned into GenerationRequests, and what both send back (the text up to a stop sequence,
the finish reason, usage, and one streaming loop).

OpenAI leaves a matched stop sequence out of the text. While streaming, the last
``len(longest stop) - 1`` characters are held back until they cannot begin a stop
sequence, so no part of one is ever sent.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

from service.contract.chat_template import ChatTemplateError
from service.engine.grammar import Grammar
from service.engine.request import FinishInfo, GenerationRequest, SamplingParams, TokenEvent
from service.engine.scheduler import RequestHandle
from service.http.adapters import adapter_of_model
from service.http.control_vectors import control_choice
from service.http.errors import ApiError
from service.http.openai_schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    JsonSchemaFormat,
    OpenAISampling,
)
from service.http.relay import merge, sse
from service.http.responses import openai_errors
from service.http.runtime import Runtime
from service.http.schemas import SEED_BOUND
from service.http.validation import InputError, Validator

OPENAI_ERRORS = openai_errors(401, 404, 413, 422, 424, 429, 503)




def response_constraint(body: OpenAISampling, validator: Validator) -> Grammar | None:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return validator.grammar("json_schema", {"type": "object"}, "response_format")
    assert isinstance(fmt, JsonSchemaFormat)
    return validator.grammar("json_schema", fmt.json_schema.json_schema,
                             "response_format.json_schema.schema")


def sampling_params(body: OpenAISampling, validator: Validator, top_n: int) -> SamplingParams:
    bias = []
    for key, value in (body.logit_bias or {}).items():
        validator.check_token_id(int(key), f"logit_bias.{key}")
        bias.append((int(key), value))
    return SamplingParams.of_request(
        do_sample=True, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
        min_p=body.min_p, repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        logit_bias=tuple(bias), seed=body.seed, top_n_logprobs=top_n,
        constraint=response_constraint(body, validator))


def choice_sampling(sampling: SamplingParams, choice: int) -> SamplingParams:
    """The n choices of a seeded request use seeds seed, seed+1, ...: reproducible, yet
    not n copies of one sample."""
    if sampling.seed is None or choice == 0:
        return sampling
    return replace(sampling, seed=(sampling.seed + choice) % SEED_BOUND)


def build_requests(body: OpenAISampling, runtime: Runtime, prompts: list[tuple[str, list[int]]],
                   max_new_tokens: int | None, top_n: int, prompt_logprobs: bool = False,
                   max_field: str = "max_tokens", token_logprobs: bool = True
                   ) -> list[GenerationRequest]:
    """n requests per prompt, under the LoRA adapter ``body.model`` names (if any);
    ``prompts`` are (field, token ids); ``token_logprobs``: the client asked for logprobs."""
    adapter = adapter_of_model(body.model, runtime)
    steering = control_choice(body.control_vector, runtime, "control_vector")
    validator = runtime.validator
    validator.check_count(len(prompts) * body.n, "n" if body.n > 1 else "prompt")
    defaults = runtime.artifact.generation_defaults
    body = defaults.fill(body)
    length_given = bool({"max_tokens", "max_completion_tokens"} & body.model_fields_set)
    stop_ids = tuple(body.stop_token_ids or ())
    validator.check_token_ids(stop_ids, "stop_token_ids")
    sampling = sampling_params(body, validator, top_n)
    requests = []
    for _, ids in prompts:
        for j in range(body.n):
            requests.append(validator.build(
                ids, choice_sampling(sampling, j), max_new_tokens, body.stop_sequences,
                max_field, prompt_logprobs=prompt_logprobs, stop_token_ids=stop_ids,
                max_new_given=length_given, author_max_new_tokens=defaults.max_new_tokens,
                ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
                token_logprobs=token_logprobs, adapter_name=adapter,
                control_vector=steering))
    return requests


def completion_requests(body: CompletionRequest, runtime: Runtime) -> list[GenerationRequest]:
    """Text prompts are tokenized, token-id prompts checked as given. ``max_tokens`` 0 with
    ``echo`` (vLLM's prompt scoring) runs one token the route leaves out; without ``echo``
    it is refused, as vLLM refuses it."""
    adapter_of_model(body.model, runtime)  # before tokenizing: an unknown model is a 404
    if body.max_tokens == 0 and not body.echo:
        raise InputError("max_tokens", "must be at least 1, or 0 with echo: true (the "
                                       "prompt scored, nothing generated)")
    if body.scores_only and body.min_tokens:
        raise InputError("min_tokens", f"{body.min_tokens} exceeds max_tokens 0")
    validator = runtime.validator
    prompts = []
    for i, prompt in enumerate(body.prompts):
        field = "prompt" if body.single_prompt else f"prompt.{i}"
        ids = (validator.tokenize(prompt, field) if isinstance(prompt, str)
               else validator.prompt_ids(prompt, field))
        prompts.append((field, ids))
    return build_requests(body, runtime, prompts, 1 if body.scores_only else body.max_tokens,
                          body.top_n_logprobs,
                          prompt_logprobs=body.echo and body.logprobs is not None,
                          token_logprobs=body.logprobs is not None)


def render_messages(runtime: Runtime, messages: list[ChatMessage], add_generation_prompt: bool,
                    extra: dict[str, Any] | None) -> str:
    try:
        return runtime.artifact.chat_template.render(
            [m.to_template() for m in messages], add_generation_prompt, extra)
    except ChatTemplateError as exc:
        raise InputError("messages", f"the chat template refused them: {exc}") from exc


def chat_requests(body: ChatCompletionRequest, runtime: Runtime) -> list[GenerationRequest]:
    adapter_of_model(body.model, runtime)  # before rendering: an unknown model is a 404
    if body.top_logprobs and not body.logprobs:
        raise InputError("top_logprobs", "needs logprobs: true")
    text = render_messages(runtime, body.messages, body.add_generation_prompt,
                           body.chat_template_kwargs)
    # The rendering holds its special tokens already (apply_chat_template's way).
    ids = runtime.validator.tokenize(text, "messages", add_special_tokens=False)
    field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    bound = runtime.artifact.limits.max_new_tokens
    if body.max_tokens is not None and body.max_tokens > bound:  # set beside the other
        raise InputError("max_tokens", f"{body.max_tokens} exceeds the server's bound "
                                       f"max_new_tokens {bound}")
    return build_requests(body, runtime, [("messages", ids)], body.max_new_tokens,
                          body.top_n_logprobs, max_field=field,
                          token_logprobs=bool(body.logprobs))


def served_name(requests: Sequence[GenerationRequest], runtime: Runtime) -> str:
    """The ``model`` a response names: the adapter the requests ran under, else the base."""
    return requests[0].adapter_name or runtime.artifact.name


def final_text(finish: FinishInfo) -> str:
    if finish.stop_offset is not None:
        return finish.generated_text[:finish.stop_offset]
    return finish.generated_text


def finish_reason(finish: FinishInfo) -> str:
    return "length" if finish.reason == "length" else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Piece(NamedTuple):
    """What one engine event lets a stream send for choice ``choice``: ``text`` starting at
    character ``offset`` of that choice's output, and the finish reason on its last."""

    choice: int
    text: str
    offset: int
    event: TokenEvent
    reason: str | None


async def stream_pieces(handles: Sequence[RequestHandle],
                        stop_sequences: Sequence[str]) -> AsyncIterator[Piece]:
    """The one streaming loop of both routes: each choice's text as it may be sent, the
    last ``len(longest stop) - 1`` characters held back until they cannot begin a stop
    sequence, and at the finish the rest up to the stop."""
    hold = max((len(s) for s in stop_sequences), default=1) - 1
    texts = ["" for _ in handles]  # generated so far, per choice
    sent = [0 for _ in handles]  # characters already sent, per choice
    async for i, event in merge(handles):
        texts[i] += "" if event.token.special else event.token.text
        if event.finish is None:
            ready = len(texts[i]) - hold
            out, reason = texts[i][sent[i]:ready] if ready > sent[i] else "", None
        else:
            out, reason = final_text(event.finish)[sent[i]:], finish_reason(event.finish)
        yield Piece(i, out, sent[i], event, reason)
        sent[i] += len(out)


def error_chunk(exc: ApiError) -> bytes:
    """The error that ends a stream after its first bytes were sent (the status is gone)."""
    return sse({"error": {"message": exc.message, "type": exc.error_type, "code": exc.code,
                          "param": None}})

