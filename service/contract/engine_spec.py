"""Names of engine.onnx, the service-only decoder graph (see export/onnx/engine_graph.py).

Kept apart from the builder so the service can read them without importing torch.

engine.onnx  (B = batch_size, T = sequence_length, M = max_sequence_length ≤ max_seq_len:
              the positions each slot holds; the service sizes it by max_total_tokens;
              K = logits_positions: the positions per row whose logits are computed)
    inputs   input_ids (int64) [B, T], position_ids (int64) [B, T]
             seqlens_k (int32) [B]: each row's total length − 1 after this call
             total_sequence_length (int32) [1]: the longest row's total length
             past_key_values.{i}.key / .value (float32, float16 with --dtype float16)
             [B, num_heads, M, head_dim]
             (num_key_value_heads under grouped-query attention)
             logits_index (int64) [B, K]: which of each row's T fed positions get logits
             (0 ≤ index < T): a decode step's 0, a prompt's last real token, or all
    outputs  logits (float32) [B, K, vocab_size]
             present.{i}.key / .value: the same buffers as the pasts, written in place
             greedy_ids (int64) [B, K]: argmax of the logits (float16 graphs only)

Rows are right-padded: a row's cache and its new tokens start at column 0.

steer (float32) [R, n_layers, d_model]: each row's control vector, per layer (row j of
the pass, the second group's rows after the first's; layer 0's never read: llama.cpp
steers blocks 1 … n_layers − 1, model/steering.py); added to the residual stream after
each block. An input with a default, one row of zeros (R = 1: every token reads row 0),
so a caller that binds none steers nothing; files exported before it lack it.

engine_mixed.onnx (``--engine-graph`` writes it beside engine.onnx, over the same
weights.bin) is the same decoder with a second group of rows, every
name above prefixed ``chunk.`` (its own batch, sequence, cache-length and logits-position
dimensions): both groups' tokens share every weight product, and each group gets its own
GroupQueryAttention, so a prompt chunk of one row (T > 1 after its cache) rides in a
decode step of many. The second group may feed no token (``chunk.input_ids`` (1, 0),
``chunk.seqlens_k`` [0], ``chunk.total_sequence_length`` [1], a (1, kv, 1, hs) scratch
cache, ``chunk.logits_index`` (1, 0): ``idle_chunk_inputs``); the graph then runs that
attention on one zero row and its logits are (1, 0, V).

engine.onnx files exported before ``logits_index`` existed lack that input and return
logits [B, T, vocab_size] for every fed position; the service reads both
(``GATHERED_INPUTS`` names what such a file may lack).
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from service.contract import io_spec as io

ENGINE_FILE = "engine.onnx"
ENGINE_MIXED_FILE = "engine_mixed.onnx"  # the same decoder with a second group of rows
# A quantised artifact's engine graph in float32, for long passes (service/contract/
# graphs.py says which graph runs which pass).
ENGINE_FLOAT32_FILE = "engine_float32.onnx"
SEQLENS_K = "seqlens_k"
TOTAL_SEQUENCE_LENGTH = "total_sequence_length"
LOGITS_INDEX = "logits_index"
MAX_SEQUENCE = "max_sequence_length"
LOGITS_POSITIONS = "logits_positions"
# A float16 engine graph's extra output (export/onnx/float16.py): int64 [B, K], the argmax of each
# row's logits, so a greedy step on the GPU copies token ids, not logits, to the host.
GREEDY_IDS = "greedy_ids"
GATHERED_INPUTS = frozenset({LOGITS_INDEX})  # absent from engine.onnx files of before it
STEER = io.STEER  # [R, n_layers, d]: the rows' control vectors (an input with a default)
STEER_ROWS = "steer_rows"  # its R


CHUNK_PREFIX = "chunk."  # the mixed graph's second group of rows (see below)


def chunk_name(name: str) -> str:
    """The mixed graph's name for ``name`` in its second group of rows."""
    return CHUNK_PREFIX + name


def engine_input_names(n_layers: int) -> list[str]:
    return [io.INPUT_IDS, io.POSITION_IDS, SEQLENS_K, TOTAL_SEQUENCE_LENGTH,
            *io.past_names(n_layers), LOGITS_INDEX]


def engine_output_names(n_layers: int) -> list[str]:
    return [io.LOGITS, *io.present_names(n_layers)]


def engine_feed(ids: np.ndarray, pos: np.ndarray, seqlens: np.ndarray, total: int,
                logits_index: np.ndarray | None, prefix: str = "") -> dict[str, np.ndarray]:
    """One group of rows' inputs to engine.onnx by name, all but the caches (bound
    by the caller, in place): every place that runs the graph feeds it through here.
    ``ids`` and ``pos`` (B, T) right-padded, ``seqlens`` (B,) each row's total length − 1
    after the pass, ``total`` the longest row's total length, ``logits_index`` (B, K) the
    positions whose logits are wanted (None: a graph of before it, every position's);
    ``prefix``: the mixed graph's second group (``CHUNK_PREFIX``)."""
    feed: dict[str, np.ndarray] = {
            io.INPUT_IDS: np.ascontiguousarray(ids, np.int64),
            io.POSITION_IDS: np.ascontiguousarray(pos, np.int64),
            SEQLENS_K: np.ascontiguousarray(seqlens, np.int32),
            TOTAL_SEQUENCE_LENGTH: np.array([total], np.int32)}
    if logits_index is not None:
        feed[LOGITS_INDEX] = np.ascontiguousarray(logits_index, np.int64)
    return {prefix + name: value for name, value in feed.items()}


def idle_chunk_inputs(input_names: Collection[str], n_layers: int, kv_heads: int,
                      head_dim: int, dtype: str = "float32") -> dict[str, np.ndarray]:
    """The inputs of a mixed graph's second group when it feeds no token: one row of none,
    whose attention the graph runs on a zero row at position 0 of a one-position scratch
    cache; empty for a graph with one group. Its outputs (``chunk.logits`` (1, 0, V), the
    scratch presents) are for the caller to ignore. ``dtype``: the graph's cache's."""
    if chunk_name(io.INPUT_IDS) not in input_names:
        return {}
    none = np.zeros((1, 0), np.int64)  # (1, 0): no token, no logits
    scratch = (1, kv_heads, 1, head_dim)  # (1, nkv, 1, hs)
    return {**engine_feed(none, none, np.zeros(1), 1, none, CHUNK_PREFIX),
            **{chunk_name(name): np.zeros(scratch, np.dtype(dtype))
               for name in io.past_names(n_layers)}}
