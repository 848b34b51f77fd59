"""/attention's JSON, encoded matrix by matrix, is byte for byte what JSONResponse gives."""

from __future__ import annotations

import json

import numpy as np
from fastapi.responses import JSONResponse

from service.http.routes.attention import _json_safe, encode_bertviz, encode_json


def test_piecewise_encoding_equals_one_json_response() -> None:
    rng = np.random.default_rng(0)
    scaled = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)  # (layers, heads, T, T)
    scaled[..., np.triu_indices(4, 1)[0], np.triu_indices(4, 1)[1]] = -np.inf  # masked
    arrays = {"scaled_scores": scaled,
              "q": rng.standard_normal((2, 3, 4, 5)).astype(np.float32)}
    head = {"model": "tiny", "tokens": [{"id": 7, "text": "é\n"}], "layers": [0, 1],
            "shapes": {k: list(v.shape) for k, v in arrays.items()}}
    expected = JSONResponse({**head, "attention": {k: _json_safe(v) for k, v in
                                                   arrays.items()}}).body
    assert encode_json(head, arrays) == expected


def test_bertviz_encoding_is_one_batch_axis_per_layer() -> None:
    """format=bertviz: per layer a (1, heads, T, T) list, bytes equal to JSONResponse's."""
    weights = np.random.default_rng(1).random((2, 3, 4, 4)).astype(np.float32)  # (L, H, T, T)
    head = {"model": "tiny", "tokens": ["a", "é\n", "c", "d"], "layers": [0, 1]}
    expected = JSONResponse({**head, "attention": [w[None].tolist() for w in weights]}).body
    encoded = encode_bertviz(head, weights)
    assert encoded == expected
    assert np.asarray(json.loads(encoded)["attention"]).shape == (2, 1, 3, 4, 4)
