"""A request's max_new_tokens from its sources, weighed in ``Validator.max_new_tokens``: the
client's length, refused over the server's bound or the room its prompt leaves; else the
model author's (generation_config.json, which also replaces an API's own default), else
the export's (config.json), else the contract's, each shortened to fit."""

from __future__ import annotations

import pytest

from service.contract import io_spec as io
from service.http.validation import InputError, Validator
from service.settings import Limits

LIMITS = Limits(max_input_tokens=99, max_total_tokens=100, max_new_tokens=80)


def validator(export: int | None) -> Validator:
    return Validator(None, LIMITS, eos_token_id=None,  # type: ignore[arg-type]
                     default_max_new_tokens=export)


def test_a_given_length_is_kept_or_refused() -> None:
    assert validator(30).max_new_tokens(50, 10, "max_tokens") == 50
    with pytest.raises(InputError, match="exceeds the server's bound max_new_tokens 80"):
        validator(30).max_new_tokens(81, 10, "max_tokens")
    with pytest.raises(InputError, match="must be <= 100; given 30 input tokens and 75"):
        validator(30).max_new_tokens(75, 30, "max_tokens")


def test_an_unset_length_takes_the_first_default_and_fits_it() -> None:
    assert validator(30).max_new_tokens(None, 10, "f", author_default=20) == 20
    assert validator(30).max_new_tokens(None, 10, "f") == 30
    assert validator(None).max_new_tokens(None, 10, "f") == io.DEFAULT_MAX_NEW_TOKENS
    assert validator(90).max_new_tokens(None, 10, "f") == 80  # the server's bound
    assert validator(30).max_new_tokens(None, 95, "f") == 5  # the room the prompt leaves
    assert validator(30).max_new_tokens(None, 100, "f") == 1  # at least one


def test_the_authors_length_replaces_an_apis_own_default_but_not_the_clients() -> None:
    # OpenAI completions' max_tokens defaults to 16: an API default, not the client's
    assert validator(30).max_new_tokens(16, 10, "f", given=False, author_default=20) == 20
    assert validator(30).max_new_tokens(16, 10, "f", given=False) == 16
    assert validator(30).max_new_tokens(16, 10, "f", author_default=20) == 16
