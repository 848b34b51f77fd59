"""POST /attention: every layer's Q, K, V, scores, scaled scores and weights for one input.

Matrices come back in bertviz's layout, (layers, heads, query, key) — or (layers, heads,
tokens, head_dim) for q, k and v — restricted to the requested layers and heads. Only the
requested layers and kinds are computed (service/viz/attention_model.py), so asking for
one layer costs that layer's share of time and memory: the viewer fetches layer by layer.
``scaled_scores`` hold -inf where the causal mask hides a key; JSON has no infinity,
so those entries are ``null`` in the json format (npz keeps the real -inf).

``format=bertviz`` returns what bertviz's ``head_view`` / ``model_view`` take: ``attention``
as one ``(1, heads, query, key)`` nested list per layer and ``tokens`` as plain strings, so
a notebook passes ``[torch.tensor(a) for a in data["attention"]]`` straight to bertviz.

``include`` may also name ``logit_lens`` (each requested layer's residual through the final
norm and LM head: the top ``top_k`` tokens and probabilities per position, and ``target``'s
probability and rank), ``residual_norms`` and ``head_attribution`` (direct logit
attribution of ``target``, default the model's next token, at ``position``, default the
last): computed in the same pass (service/viz/look_inside.py). An artifact exported before
them answers 409 for those and keeps serving the maps.

``adapter_id`` asks for the attention under a served LoRA adapter (404 for a name not
served): the attention model runs attention_lora.onnx with that adapter's weights; 501
for an artifact without that graph.

``control_vector`` ({name, scale, layers?}, checked as /generate's: 404 for a name not
served, 422 for a scale beyond --max-control-scale) asks for everything above under a
served control vector: its scaled rows are bound to the graph's ``steer`` input, added
after each block as the engine adds a steered row's. An artifact whose attention.onnx (or,
with ``adapter_id``, attention_lora.onnx) predates that input answers 409. The response
names the vector it was computed under, resolved (``control_vector``: name, scale, layers;
npz: ``control_vector.name``, ``.scale``, ``.layers``); without one it has no such member.
"""

from __future__ import annotations

import asyncio
import io as _io
import json
import math
from typing import Any

import numpy as np
from fastapi import APIRouter, Depends
from fastapi.responses import Response

from service.contract import io_spec as io
from service.contract.adapter_spec import lora_file
from service.engine.request import ControlChoice
from service.http.adapters import adapter_of_id
from service.http.control_vectors import control_choice, control_echo, control_rows
from service.http.deps import ReadyRuntime, require_api_key
from service.http.errors import ApiError
from service.http.responses import TgiError, tgi_errors
from service.http.runtime import Runtime
from service.http.schemas import AttentionRequest
from service.http.validation import InputError
from service.viz.look_inside import HEAD_ATTRIBUTION, MEMBERS, LookInside, inside_json
from service.viz.render import heatmap_grid

router = APIRouter(tags=["attention"], dependencies=[Depends(require_api_key)])


def _pick(requested: list[int] | None, available: int, field: str) -> list[int]:
    if requested is None:
        return list(range(available))
    bad = [i for i in requested if i >= available]
    if bad:
        raise InputError(field, f"{bad} out of range: the model has {available} ({field})")
    if len(set(requested)) != len(requested):
        raise InputError(field, "contains duplicates")
    return requested


def _json_safe(a: np.ndarray) -> Any:
    """Nested lists with every non-finite entry (the masked -inf) as None."""
    values = a.tolist()
    if np.isfinite(a).all():
        return values

    def walk(x: Any) -> Any:
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x if math.isfinite(x) else None

    return walk(values)


# The JSON body's one member declared here: the rest is the docstring's and docs/api.md's.
_JSON_SCHEMA = {"type": "object", "properties": {"control_vector": {
    "type": "object", "description": "the control vector it was computed under (only when "
    "the request named one): layers resolved, [1, n_layers - 1] where none were given",
    "properties": {"name": {"type": "string"}, "scale": {"type": "number"},
                   "layers": {"type": "array", "items": {"type": "integer"},
                              "minItems": 2, "maxItems": 2}},
    "required": ["name", "scale", "layers"]}}}


@router.post("/attention", summary="Attention matrices of every layer and head (bertviz layout)",
             responses={200: {"description": "format json (default) or bertviz: JSON; npz; png",
                              "content": {"application/json": {"schema": _JSON_SCHEMA},
                                          "application/octet-stream": {"schema": {
                                              "type": "string", "format": "binary"}},
                                          "image/png": {"schema": {"type": "string",
                                                                   "format": "binary"}}}},
                        **tgi_errors(401, 404, 409, 413, 422, 501, 503),
                        429: {"model": TgiError, "description":
                              "/attention is at capacity: attention_max_concurrent running "
                              "and attention_max_queued waiting (Retry-After: 1)"}})
async def attention(body: AttentionRequest, runtime: ReadyRuntime) -> Response:
    config = runtime.artifact.config
    ids = runtime.validator.tokenize(body.inputs, "inputs")
    layers = _pick(body.layers, config.n_layers, "layers")
    heads = _pick(body.heads, config.n_heads, "heads")
    included = list(dict.fromkeys(body.include))
    if body.format in ("png", "bertviz") and included != ["weights"]:
        raise InputError("include", f"the {body.format} format carries only ['weights']")
    kinds = [k for k in included if k not in MEMBERS]
    adapter = adapter_of_id(body.adapter_id, runtime, "adapter_id")
    if adapter is not None and not runtime.attention_takes_adapters:
        raise ApiError(501, "adapter_id: this artifact has no attention_lora.onnx (export "
                            "writes it beside attention.onnx), so /attention computes the "
                            "base model's only; ask without adapter_id", "not_implemented",
                       param="adapter_id", code="not_implemented")
    assert runtime.attention is not None
    choice = control_choice(body.control_vector, runtime, "control_vector")
    steer = _steer(choice, runtime, adapter)
    control = None if choice is None else control_echo(choice, config.n_layers)
    inside = _look_inside(body, runtime, ids, [k for k in included if k in MEMBERS], adapter)
    # Bounded (settings attention_max_concurrent/_queued; 429 beyond): running and encoding
    # a request costs seconds of CPU, and unbounded floods of them starve decoding.
    async with runtime.attention_gate.admit():
        if inside is None:
            computed = await asyncio.get_running_loop().run_in_executor(
                runtime.attention_threads, runtime.attend, ids, kinds, layers, adapter, steer)
            seen: dict[str, np.ndarray] = {}
        else:
            computed, seen = await asyncio.get_running_loop().run_in_executor(
                runtime.attention_threads, runtime.look_inside, ids, kinds, layers, adapter,
                inside, steer)
        # Encoding can take seconds (all kinds at full length is ~55 MB of JSON): off the
        # event loop, so the token streams of other requests do not stall meanwhile.
        return await asyncio.to_thread(render, body, runtime, ids, layers, heads, computed,
                                       seen, control)


def _steer(choice: ControlChoice | None, runtime: Runtime, adapter: str | None
           ) -> np.ndarray | None:
    """The request's control vector (checked as /generate checks it) as the (n_layers, d)
    rows to bind (None: none); 409 where the graph to run takes none."""
    if choice is None:
        return None
    assert runtime.attention is not None
    if not runtime.attention.steers:
        graph = io.ATTENTION_FILE
    elif adapter is not None and not runtime.attention.steers_under_adapters():
        graph = lora_file(io.ATTENTION_FILE)
    else:
        return control_rows(choice, runtime, "control_vector")
    raise ApiError(409, f"control_vector: this artifact's {graph} takes no control vector "
                        "(it was exported before /attention took one): re-export it "
                        "(attnserve export) to ask for one"
                        + (", or ask without adapter_id" if graph != io.ATTENTION_FILE
                           else "; without control_vector the maps still work"),
                   "artifact_outdated", param="control_vector", code="artifact_outdated")


def _look_inside(body: AttentionRequest, runtime: Runtime, ids: list[int],
                 members: list[str], adapter: str | None) -> LookInside | None:
    """The request's logit_lens / head_attribution / residual_norms, checked (None: none)."""
    if not members:
        return None
    assert runtime.attention is not None
    if not runtime.attention.looks_inside:
        raise ApiError(409, f"include: {members} need an attention.onnx exported with the "
                            "logit lens and attribution outputs; this artifact predates them: "
                            "re-export it (attnserve export) to ask for them (the attention "
                            "maps still work)", "artifact_outdated", param="include",
                       code="artifact_outdated")
    if adapter is not None and HEAD_ATTRIBUTION in members:
        raise ApiError(501, "adapter_id: head_attribution under an adapter is not computed "
                            "(each head's output misses o_proj's LoRA update); ask without "
                            "adapter_id, or for logit_lens / residual_norms",
                       "not_implemented", param="adapter_id", code="not_implemented")
    vocab = runtime.artifact.config.vocab_size
    if body.top_k > vocab:
        raise InputError("top_k", f"{body.top_k} is more than the vocabulary's {vocab}")
    if body.target is not None and body.target >= vocab:
        raise InputError("target", f"{body.target} out of range: the vocabulary has {vocab}")
    if body.position is not None and body.position >= len(ids):
        raise InputError("position", f"{body.position} out of range: the input has "
                                     f"{len(ids)} tokens")
    return LookInside(tuple(members), body.top_k, body.target,
                      -1 if body.position is None else body.position)


def render(body: AttentionRequest, runtime: Runtime, ids: list[int], layers: list[int],
           heads: list[int], computed: dict[str, np.ndarray],
           seen: dict[str, np.ndarray] | None = None,
           control: dict[str, Any] | None = None) -> Response:
    """``computed``: {kind: (len(layers), all heads, ...)}, the requested layers in order;
    ``seen``: LookInside.collect's arrays (logit lens, norms, attribution), if asked;
    ``control``: the control vector it was computed under (control_echo), if any."""
    seen = seen or {}
    echo = {} if control is None else {"control_vector": control}
    codec = runtime.artifact.codec
    all_heads = heads == list(range(runtime.artifact.config.n_heads))
    arrays = {k: v if all_heads else np.ascontiguousarray(v[:, heads])
              for k, v in computed.items()}
    # Grouped-query attention: several query heads share one key/value head (their k and
    # v entries are then equal); this says which.
    kv_heads = [runtime.artifact.config.kv_head_of(h) for h in heads]
    tokens = [codec.token_text(i) for i in ids]

    if body.format == "png":
        return Response(heatmap_grid(arrays["weights"], tokens, layers, heads),
                        media_type="image/png")
    if body.format == "npz":
        buffer = _io.BytesIO()
        contents: dict[str, Any] = {
            "token_ids": np.asarray(ids, dtype=np.int64),
            "tokens": np.asarray(tokens, dtype=np.str_),
            "layers": np.asarray(layers, dtype=np.int64),
            "heads": np.asarray(heads, dtype=np.int64),
            "kv_heads": np.asarray(kv_heads, dtype=np.int64), **arrays, **seen}
        if control is not None:
            contents |= {"control_vector.name": np.asarray(control["name"], dtype=np.str_),
                         "control_vector.scale": np.asarray(control["scale"], np.float64),
                         "control_vector.layers": np.asarray(control["layers"], np.int64)}
        np.savez(buffer, **contents)
        return Response(buffer.getvalue(), media_type="application/octet-stream",
                        headers={"Content-Disposition": 'attachment; filename="attention.npz"'})
    # JSON is encoded in a worker process (service/low_priority.py): seconds of GIL-bound work
    # in this one would stall the decode loop.
    if body.format == "bertviz":
        return Response(runtime.attention_encoder.call(encode_bertviz, {
            "model": runtime.artifact.name, "tokens": tokens, "token_ids": ids,
            "layers": layers, "heads": heads, **echo,
        }, arrays["weights"]), media_type="application/json")
    return Response(runtime.attention_encoder.call(encode_json, {
        "model": runtime.artifact.name,
        "tokens": [{"id": i, "text": t} for i, t in zip(ids, tokens, strict=True)],
        "layers": layers, "heads": heads, "kv_heads": kv_heads,
        "layout": "(layers, heads, query, key); q, k, v: (layers, heads, token, head_dim); "
                  "k and v of query head h are those of key/value head kv_heads[h]",
        "shapes": {k: list(v.shape) for k, v in arrays.items()},
        **inside_json(seen, body, codec.token_text, len(ids)), **echo,
    }, arrays), media_type="application/json")


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def encode_json(head: dict[str, Any], arrays: dict[str, np.ndarray]) -> bytes:
    """``head`` plus ``"attention": arrays``, the bytes JSONResponse would give, built one
    (layer, head) matrix per json.dumps call: the C encoder holds the GIL for a whole call,
    and one call over ~55 MB stalled the engine and every token stream for seconds."""
    kinds = []
    for kind, a in arrays.items():  # (layers, heads, rows, cols)
        per_layer = ("[" + ",".join(_dumps(_json_safe(m)) for m in layer) + "]" for layer in a)
        kinds.append(_dumps(kind) + ":[" + ",".join(per_layer) + "]")
    return (_dumps(head)[:-1] + ',"attention":{' + ",".join(kinds) + "}}").encode()


def encode_bertviz(head: dict[str, Any], weights: np.ndarray) -> bytes:
    """``head`` plus ``"attention"``: per layer a ``(1, heads, query, key)`` nested list, the
    tuple-of-tensors layout bertviz takes (batch axis included), encoded matrix by matrix
    like ``encode_json``. Weights are finite (masked keys are 0), so no nulls."""
    per_layer = ("[[" + ",".join(_dumps(m.tolist()) for m in layer) + "]]"
                 for layer in weights)  # weights: (layers, heads, T, T)
    return (_dumps(head)[:-1] + ',"attention":[' + ",".join(per_layer) + "]}").encode()
