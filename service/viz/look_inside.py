"""What an /attention request asks of attention.onnx's look-inside outputs, and its answer.

The members (``logit_lens``, ``head_attribution``, ``residual_norms``) are outputs of the
same graph as the attention maps (service/contract/lens_spec.py), fetched in the same run:
one request, one pass. This module turns a request into the outputs and feeds it needs
and the fetched values into per-member arrays; the route encodes them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.contract import lens_spec as lens

LOGIT_LENS, HEAD_ATTRIBUTION, RESIDUAL_NORMS = "logit_lens", "head_attribution", "residual_norms"
MEMBERS = (LOGIT_LENS, HEAD_ATTRIBUTION, RESIDUAL_NORMS)


@dataclass(frozen=True)
class LookInside:
    """The look-inside members of one request and their parameters."""

    members: tuple[str, ...]
    top_k: int = lens.INPUT_DEFAULTS[lens.TOP_K]
    target: int | None = None  # a token id; None: the lens has none, attribution the argmax
    position: int = -1  # attribution's position; -1: the last

    def outputs(self, layers: Sequence[int]) -> list[str]:
        """The graph outputs to fetch: the lens and norms of ``layers``, attribution whole."""
        names: list[str] = []
        if RESIDUAL_NORMS in self.members:
            names += [lens.residual_norm_name(i) for i in layers]
        if LOGIT_LENS in self.members:
            kinds = lens.LENS_KINDS if self.target is not None else ("top_ids", "top_probs")
            names += [lens.lens_output_name(i, k) for k in kinds for i in layers]
        if HEAD_ATTRIBUTION in self.members:
            names += [lens.ATTRIBUTION_TARGET, lens.ATTRIBUTION_LOGIT, lens.ATTRIBUTION_TERMS]
        return names

    def feeds(self) -> dict[str, np.ndarray]:
        target = lens.NO_TARGET if self.target is None else self.target
        return {lens.TOP_K: np.array([self.top_k], np.int64),
                lens.TARGET: np.array([target], np.int64),
                lens.POSITION: np.array([self.position], np.int64)}

    def collect(self, values: dict[str, np.ndarray], layers: Sequence[int], n_layers: int,
                n_heads: int) -> dict[str, np.ndarray]:
        """The fetched ``values`` (batch of one) as named arrays: ``residual_norms``
        (layers, T); ``logit_lens.top_ids`` / ``.top_probs`` (layers, T, k) and, with a
        target, ``.target_probs`` / ``.target_ranks`` (layers, T); ``head_attribution.*``
        (``heads`` (L, nh), ``attention``, ``attention_bias``, ``mlp``, ``mlp_bias`` and,
        where the graph takes steer, ``control_vector`` (L,); ``embedding``,
        ``norm_bias``, ``logit``, ``target``: scalars)."""
        out: dict[str, np.ndarray] = {}
        if RESIDUAL_NORMS in self.members:
            out[RESIDUAL_NORMS] = np.stack(
                [values[lens.residual_norm_name(i)][0] for i in layers])  # (layers, T)
        if LOGIT_LENS in self.members:
            kinds = {"top_ids": "top_ids", "top_probs": "top_probs"}
            if self.target is not None:
                kinds |= {"target_prob": "target_probs", "target_rank": "target_ranks"}
            for kind, key in kinds.items():
                out[f"{LOGIT_LENS}.{key}"] = np.stack(
                    [values[lens.lens_output_name(i, kind)][0] for i in layers])
        if HEAD_ATTRIBUTION in self.members:
            out |= _attribution(values, n_layers, n_heads)
        return out


def _attribution(values: dict[str, np.ndarray], n_layers: int, n_heads: int
                 ) -> dict[str, np.ndarray]:
    """attribution.terms split by lens_spec.terms' order: per layer its heads, then its
    attention bias, MLP, MLP bias and (a graph that takes steer) control vector."""
    terms = values[lens.ATTRIBUTION_TERMS][0]  # (n,)
    per_layer = terms[1:-1].reshape(n_layers, -1)  # (L, nh + the layer's other terms)
    heads = per_layer[:, :n_heads]  # (L, nh)
    p = f"{HEAD_ATTRIBUTION}."
    named = {f"{p}{name}": per_layer[:, n_heads + j]
             for j, name in enumerate(lens.LAYER_TERMS[:per_layer.shape[1] - n_heads])}
    return {f"{p}target": values[lens.ATTRIBUTION_TARGET][0],
            f"{p}logit": values[lens.ATTRIBUTION_LOGIT][0, 0],
            f"{p}embedding": terms[0], f"{p}heads": heads,
            f"{p}attention": heads.sum(axis=1), **named, f"{p}norm_bias": terms[-1]}


def inside_json(seen: dict[str, np.ndarray], request: Any, token_text: Callable[[int], str],
                n_tokens: int) -> dict[str, Any]:
    """The JSON members of ``seen`` (LookInside.collect's arrays; {} when none were asked):
    ``residual_norms`` (layers, T); ``logit_lens`` with each top id's text; and
    ``head_attribution``, whose terms (embedding, heads, attention_bias, mlp, mlp_bias,
    control_vector where the graph has it, norm_bias; ``attention`` is its heads' sum)
    add up to ``logit``."""
    out: dict[str, Any] = {}
    if RESIDUAL_NORMS in seen:
        out[RESIDUAL_NORMS] = seen[RESIDUAL_NORMS].tolist()
    p = f"{LOGIT_LENS}."
    if f"{p}top_ids" in seen:
        top = seen[f"{p}top_ids"]  # (layers, T, k)
        texts = {int(i): token_text(int(i)) for i in np.unique(top)}
        out[LOGIT_LENS] = {
            "top_k": int(top.shape[-1]), "target": request.target,
            "layout": "(layers, token, rank); target_probs, target_ranks: (layers, token)",
            "top_ids": top.tolist(),
            "top_tokens": [[[texts[i] for i in row] for row in layer] for layer in top.tolist()],
            "top_probs": seen[f"{p}top_probs"].tolist(),
            **{key: seen[f"{p}{key}"].tolist() for key in ("target_probs", "target_ranks")
               if f"{p}{key}" in seen}}
    p = f"{HEAD_ATTRIBUTION}."
    if f"{p}terms" in seen or f"{p}heads" in seen:
        target = int(seen[f"{p}target"])
        position = request.position if request.position is not None else n_tokens - 1
        out[HEAD_ATTRIBUTION] = {
            "position": position, "target": target, "target_token": token_text(target),
            "logit": float(seen[f"{p}logit"]),
            "layout": "heads: (layers, heads); attention (its heads' sum), attention_bias, "
                      "mlp, mlp_bias, control_vector: (layers,); every term plus embedding "
                      "and norm_bias adds up to logit (the model has no LM-head bias)",
            **{key: seen[f"{p}{key}"].tolist() for key in (
                "embedding", "heads", "attention", "attention_bias", "mlp", "mlp_bias",
                "control_vector", "norm_bias") if f"{p}{key}" in seen}}
    return out
