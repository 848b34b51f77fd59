"""Names of engine.onnx, the service-only decoder graph (see export/engine_graph.py).

Kept apart from the builder so the service can read them without importing torch.

engine.onnx  (B = batch_size, T = sequence_length, M = max_sequence_length ≤ max_seq_len:
              the positions each slot holds; the service sizes it by max_total_tokens;
              K = logits_positions: the positions per row whose logits are computed)
    inputs   input_ids (int64) [B, T], position_ids (int64) [B, T]
             seqlens_k (int32) [B]: each row's total length − 1 after this call
             total_sequence_length (int32) [1]: the longest row's total length
             past_key_values.{i}.key / .value (float32) [B, num_heads, M, head_dim]
             (num_key_value_heads under grouped-query attention)
             logits_index (int64) [B, K]: which of each row's T fed positions get logits
             (0 ≤ index < T): a decode step's 0, a prompt's last real token, or all
    outputs  logits (float32) [B, K, vocab_size]
             present.{i}.key / .value: the same buffers as the pasts, written in place

Rows are right-padded: a row's cache and its new tokens start at column 0.

engine.onnx files exported before ``logits_index`` existed lack that input and return
logits [B, T, vocab_size] for every fed position; the service reads both
(``GATHERED_INPUTS`` names what such a file may lack).
"""

from __future__ import annotations

from service.contract import io_spec as io

ENGINE_FILE = "engine.onnx"
SEQLENS_K = "seqlens_k"
TOTAL_SEQUENCE_LENGTH = "total_sequence_length"
LOGITS_INDEX = "logits_index"
MAX_SEQUENCE = "max_sequence_length"
LOGITS_POSITIONS = "logits_positions"
GATHERED_INPUTS = frozenset({LOGITS_INDEX})  # absent from engine.onnx files of before it


def engine_input_names(n_layers: int) -> list[str]:
    return [io.INPUT_IDS, io.POSITION_IDS, SEQLENS_K, TOTAL_SEQUENCE_LENGTH,
            *io.past_names(n_layers), LOGITS_INDEX]


def engine_output_names(n_layers: int) -> list[str]:
    return [io.LOGITS, *io.present_names(n_layers)]
