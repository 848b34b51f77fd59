"""Both APIs' sampling fields read by the one ``SamplingParams.of_request``: OpenAI samples
unless temperature is 0 (greedy); TGI is greedy unless ``do_sample`` or a warper other
than neutral asks to sample; greedy rows keep the neutral temperature."""

from __future__ import annotations

from typing import Any

import pytest

from service.engine.request import SamplingParams
from service.http import openai_requests, tgi_requests
from service.http.openai_schemas import CompletionRequest
from service.http.schemas import GenerateParameters


def openai(**fields: Any) -> SamplingParams:
    body = CompletionRequest.model_validate({"model": "m", "prompt": "a", **fields})
    return openai_requests.sampling_params(body, None, 0)  # type: ignore[arg-type]


def tgi(**fields: Any) -> SamplingParams:
    return tgi_requests.sampling_params(None, GenerateParameters.model_validate(fields))  # type: ignore[arg-type]


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, SamplingParams(do_sample=True)),
    ({"temperature": 0}, SamplingParams()),
    ({"temperature": 0, "top_p": 0.5, "top_k": 5}, SamplingParams(top_p=0.5, top_k=5)),
    ({"temperature": 0.7, "top_k": -1}, SamplingParams(do_sample=True, temperature=0.7)),
    ({"temperature": 1.0, "top_p": 0.9}, SamplingParams(do_sample=True, top_p=0.9)),
])
def test_openai_samples_unless_the_temperature_is_zero(fields: dict[str, Any],
                                                        expected: SamplingParams) -> None:
    assert openai(**fields) == expected


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, SamplingParams()),
    ({"temperature": 1.0, "top_p": 1.0, "top_k": 0}, SamplingParams()),
    ({"do_sample": True}, SamplingParams(do_sample=True)),
    ({"temperature": 0.5}, SamplingParams(do_sample=True, temperature=0.5)),
    ({"top_k": 3}, SamplingParams(do_sample=True, top_k=3)),
    ({"top_p": 0.8}, SamplingParams(do_sample=True, top_p=0.8)),
    ({"typical_p": 0.9}, SamplingParams(do_sample=True, typical_p=0.9)),
])
def test_tgi_samples_when_asked_or_when_a_warper_is_not_neutral(
        fields: dict[str, Any], expected: SamplingParams) -> None:
    assert tgi(**fields) == expected
