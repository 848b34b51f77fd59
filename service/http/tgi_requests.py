"""TGI's generation routes (/generate, /generate_stream, and / for TGI's clients) on the
engine: the request's parameters turned into a GenerationRequest."""

from __future__ import annotations

from dataclasses import replace

from service.engine.request import GenerationRequest, SamplingParams
from service.http.adapters import adapter_of_id
from service.http.control_vectors import control_choice
from service.http.runtime import Runtime
from service.http.schemas import GenerateParameters, GenerateRequest, JsonGrammar, StreamRequest


def sampling_params(runtime: Runtime, params: GenerateParameters) -> SamplingParams:
    """TGI's sampling: ``do_sample``, or temperature, top_k, top_p or typical_p other than
    neutral, turn it on (``SamplingParams.of_request``); a grammar constrains it."""
    sampling = SamplingParams.of_request(
        do_sample=params.do_sample, temperature=params.temperature, top_k=params.top_k,
        top_p=params.top_p, typical_p=params.typical_p,
        repetition_penalty=params.repetition_penalty or 1.0,
        frequency_penalty=params.frequency_penalty or 0.0,
        seed=params.seed,
        top_n_logprobs=params.top_n_tokens or 0,
    )
    grammar = params.grammar
    if grammar is None:
        return sampling
    if isinstance(grammar, JsonGrammar):
        constraint = runtime.validator.grammar("json_schema", grammar.value,
                                               "parameters.grammar.value")
    else:
        constraint = runtime.validator.grammar("regex", grammar.value,
                                               "parameters.grammar.value")
    return replace(sampling, constraint=constraint)


def build_request(runtime: Runtime, text: str, params: GenerateParameters,
                  sampling: SamplingParams, field: str, stream: bool) -> GenerationRequest:
    """A stream reports every token's logprob (TGI's token object); /generate only in its
    details. ``parameters.adapter_id`` names the LoRA adapter (checked by the caller)."""
    validator = runtime.validator
    ids = validator.tokenize(text, field, params.truncate)
    return validator.build(ids, sampling, params.max_new_tokens,
                           params.stop, "parameters.max_new_tokens",
                           prompt_logprobs=params.decoder_input_details,
                           token_logprobs=(stream or params.details
                                           or params.decoder_input_details),
                           adapter_name=params.adapter_id,
                           control_vector=control_choice(params.control_vector, runtime,
                                                         "parameters.control_vector"))


def generate_requests(body: GenerateRequest, runtime: Runtime) -> list[GenerationRequest]:
    """/generate's requests: one per input (TGI takes a string; a list is ours)."""
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    fields = ["inputs"] if isinstance(body.inputs, str) else [f"inputs.{i}" for i in
                                                              range(len(texts))]
    runtime.validator.check_count(len(texts), "inputs")
    adapter_of_id(body.parameters.adapter_id, runtime)
    sampling = sampling_params(runtime, body.parameters)
    return [build_request(runtime, t, body.parameters, sampling, f, stream=False)
            for t, f in zip(texts, fields, strict=True)]


def stream_request(body: StreamRequest, runtime: Runtime) -> GenerationRequest:
    """/generate_stream's request."""
    params = body.parameters
    adapter_of_id(params.adapter_id, runtime)
    return build_request(runtime, body.inputs, params, sampling_params(runtime, params),
                         "inputs", stream=True)
