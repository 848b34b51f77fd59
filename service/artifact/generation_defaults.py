"""A model author's sampling defaults (generation_config.json) for the OpenAI routes.

vLLM's ``--generation-config auto``: Qwen2.5-Instruct, for one, ships temperature 0.7,
top_p 0.8, top_k 20 and repetition_penalty 1.05, tuned for the model; a client that
leaves one of those fields out of its request gets the author's value instead of the
API's neutral default. A field the request sets always wins. ``max_new_tokens`` becomes
the default completion length. As in vLLM (which reads the file through transformers'
``to_diff_dict``), a value equal to transformers' own default (temperature 1, top_p 1,
top_k 50, repetition_penalty 1) counts as unset. TGI's routes do not read the file (TGI
does not). The defaults are the contract's one ``GenerationDefaults`` (the class an
artifact's config.json carries too).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from service.contract import io_spec as io
from service.contract.io_spec import GenerationDefaults

# field: (lowest, highest, lowest is allowed): the OpenAI schemas' own bounds.
_FLOAT_BOUNDS = {"temperature": (0.0, 2.0, True), "top_p": (0.0, 1.0, False),
                 "min_p": (0.0, 1.0, True), "repetition_penalty": (0.0, 10.0, False)}

# transformers.GenerationConfig's defaults: written out, they say nothing.
_TRANSFORMERS_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50,
                          "repetition_penalty": 1.0}

__all__ = ["GenerationDefaults", "parse_generation_defaults"]


def _refuse(field: str, value: object, why: str) -> ValueError:
    return ValueError(f"{io.GENERATION_CONFIG_FILE}: {field} {value!r} {why}; fix the file or "
                      f"start with --generation-config off")


def parse_generation_defaults(data: Mapping[str, Any]) -> GenerationDefaults:
    values: dict[str, Any] = {}
    for field, (low, high, closed) in _FLOAT_BOUNDS.items():
        value = data.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
                value) or not (low <= value if closed else low < value) or value > high:
            raise _refuse(field, value, f"is not a number in {'[' if closed else '('}"
                                        f"{low:g}, {high:g}]")
        values[field] = float(value)
    for field, low in (("top_k", -1), ("max_new_tokens", 1)):
        value = data.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise _refuse(field, value, f"is not an integer ≥ {low}")
        values[field] = value
    return GenerationDefaults(**{k: v for k, v in values.items()
                                 if _TRANSFORMERS_DEFAULTS.get(k) != v})

