"""Which control vector a request steers with: a served one's name, a scale within
``--max-control-scale``, and optionally a layer range (docs/steering.md).

TGI's routes read ``parameters.control_vector``, the OpenAI routes the extra body field
``control_vector``; both ``{"name", "scale", "layers"?}``. A name the server does not serve
is a 404 in the route's error shape, a scale beyond the maximum or a range that ends before
it starts a 422 naming the field; the engine refuses an unknown name again
(``UnknownControlVector``, the same 404) where it was unloaded between this check and the
submit.

/attention takes the same ``control_vector`` (the same checks, the same 404 and 422) and
binds :func:`control_rows`, the vector's scaled rows, to attention.onnx's ``steer``; its
response names the vector it was computed under (:func:`control_echo`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from service.engine.control_vectors import UnknownControlVector, control_entries
from service.engine.request import ControlChoice
from service.http.errors import unknown_vector
from service.http.runtime import Runtime
from service.http.schemas import ControlVectorChoice
from service.http.validation import InputError


def control_vector_names(runtime: Runtime) -> list[str]:
    """The vectors a request may name now: the engine's; before it exists, the settings'."""
    engine = runtime.engine
    if engine is None:
        return [name for name, _ in control_entries(runtime.settings.control_vectors)]
    vectors = engine.control_vectors
    return vectors.names if vectors is not None else []


def control_choice(choice: ControlVectorChoice | None, runtime: Runtime,
                   field: str) -> ControlChoice | None:
    """The engine's form of a request's ``choice`` (None: no vector), checked."""
    if choice is None:
        return None
    if choice.name not in control_vector_names(runtime):
        raise unknown_vector(choice.name, field)
    limit = runtime.settings.max_control_scale
    if abs(choice.scale) > limit:
        raise InputError(f"{field}.scale", f"|scale| must be <= {limit} "
                                           f"(--max-control-scale); given {choice.scale}")
    layers = None
    if choice.layers is not None:
        start, end = choice.layers
        if start > end:
            raise InputError(f"{field}.layers", f"[{start}, {end}] ends before it starts")
        layers = (start, end)
    return ControlChoice(choice.name, choice.scale, layers)


def control_rows(choice: ControlChoice, runtime: Runtime, field: str) -> np.ndarray:
    """The (n_layers, d) rows a request under ``choice`` (from :func:`control_choice`) adds
    after each block, as the engine adds a steered row's; the 404 for a name unloaded
    since the check."""
    engine = runtime.engine
    vectors = engine.control_vectors if engine is not None else None
    try:
        if vectors is None:
            raise UnknownControlVector(choice.name)
        return vectors.table(vectors.resolve(choice))
    except UnknownControlVector:
        raise unknown_vector(choice.name, field) from None


def control_echo(choice: ControlChoice, n_layers: int) -> dict[str, Any]:
    """``choice`` as a response names it, resolved: ``layers`` absent in the request is
    the blocks a vector is added after, 1 … n_layers − 1 (block 0's output never is)."""
    layers = choice.layers if choice.layers is not None else (1, n_layers - 1)
    return {"name": choice.name, "scale": choice.scale, "layers": list(layers)}
