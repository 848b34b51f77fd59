"""Names of attention.onnx's look-inside outputs: logit lens, residual norms, head attribution.

Beside the attention intermediates (service/contract/io_spec.py), attention.onnx computes
what the residual stream says at each layer. Kept apart from io_spec so the service reads
it without torch, as adapter_spec.py is. Every name here is an output the service fetches
only when a request asks (a cut graph runs only their ancestors: service/viz/graph_cut.py),
so the old members cost what they did.

Inputs, each an initializer too (an ONNX input with a default: a run that feeds only
input_ids, attention_mask and position_ids still works):
    inspect.top_k (int64) [1]       the lens's k (default 5)
    inspect.target (int64) [1]      a token id; -1 (default): attribution's target is the
                                    model's own next token, and the lens has none
    inspect.position (int64) [1]    the position attribution looks at (default -1: the last)
The control vector the residual stream is steered by, ``steer``, is io_spec.py's: the
lens, norms and attribution all read the steered stream.

Outputs (B = batch, T = tokens, L = layers):
    residual_norm.{i}      [B, T]      the residual stream's L2 norm after layer i
    lens.{i}.top_ids       [B, T, k]   int64: the top-k tokens of ln_f(residual_i)·W_U
    lens.{i}.top_probs     [B, T, k]   their probabilities (softmax over the whole vocabulary)
    lens.{i}.target_prob   [B, T]      the target's probability (meaningless at target -1)
    lens.{i}.target_rank   [B, T]      int64: how many tokens have a larger logit (0: top)
    attribution.target     [1]         int64: the token attributed (given, or the argmax)
    attribution.logit      [B, 1]      its logit at the position
    attribution.terms      [B, N]      its logit's direct contributions (:func:`terms`)
"""

from __future__ import annotations

TOP_K, TARGET, POSITION = "inspect.top_k", "inspect.target", "inspect.position"
INPUT_DEFAULTS = {TOP_K: 5, TARGET: -1, POSITION: -1}
MAX_TOP_K = 20  # the lens's k at most (the request schema's bound)
NO_TARGET = -1

LENS_KINDS = ("top_ids", "top_probs", "target_prob", "target_rank")
ATTRIBUTION_TARGET = "attribution.target"
ATTRIBUTION_LOGIT = "attribution.logit"
ATTRIBUTION_TERMS = "attribution.terms"
# one layer's rows of attribution.terms, after its heads' (one per head); the control
# vector's (io_spec.STEER's row added after the block) only in graphs that take steer
LAYER_TERMS = ("attention_bias", "mlp", "mlp_bias", "control_vector")
UNSTEERED_LAYER_TERMS = LAYER_TERMS[:3]  # graphs exported before steer


def residual_norm_name(layer: int) -> str:
    return f"residual_norm.{layer}"


def lens_output_name(layer: int, kind: str) -> str:
    if kind not in LENS_KINDS:
        raise ValueError(f"unknown lens output kind {kind!r}; one of {LENS_KINDS}")
    return f"lens.{layer}.{kind}"


def terms(n_layers: int, n_heads: int, steered: bool = True) -> list[str]:
    """The rows of attribution.terms, in order: ``embedding``; per layer i ``l{i}.head{h}``
    for each head, then ``l{i}.attention_bias``, ``l{i}.mlp``, ``l{i}.mlp_bias`` and (a
    graph that takes steer, ``steered``) ``l{i}.control_vector``, the steer row added
    after block i (0 at layer 0 and without a vector); last ``norm_bias`` (the final
    LayerNorm's β; 0 under RMSNorm). Their sum is the logit (no family has an LM-head
    bias)."""
    rows = ["embedding"]
    for i in range(n_layers):
        rows += [f"l{i}.head{h}" for h in range(n_heads)]
        rows += [f"l{i}.{t}" for t in (LAYER_TERMS if steered else UNSTEERED_LAYER_TERMS)]
    return [*rows, "norm_bias"]


def inspect_output_names(n_layers: int) -> list[str]:
    """Every look-inside output: an artifact whose attention.onnx lacks one predates them."""
    return [*(residual_norm_name(i) for i in range(n_layers)),
            *(lens_output_name(i, k) for i in range(n_layers) for k in LENS_KINDS),
            ATTRIBUTION_TARGET, ATTRIBUTION_LOGIT, ATTRIBUTION_TERMS]
