"""Trace model.gpt.GPT into the two ONNX graphs of an artifact.

``model.onnx`` is one merged decoder graph: the same graph runs prefill (past tensors of
length 0) and cached decode, because the past is simply concatenated in front of this
call's keys and values. ``attention.onnx`` is the introspection graph: no cache, every
layer's Q, K, V, raw and scaled scores and attention weights as outputs.

Both are traced with the dynamo-based ``torch.onnx.export(dynamo=True)``; its symbolic
dimension names (``s10``, ``s70 + s89`` ...) are then renamed to the contract's names from
service/contract/io_spec.py, so the graph reads exactly as the manifest documents it.
"""

from __future__ import annotations

import contextlib
import io as _io
import logging
import re
import warnings
from pathlib import Path

import onnx
import torch
from torch import Tensor, nn

from model.config import GPTConfig
from model.gpt import GPT
from service.contract import io_spec as io

DEFAULT_OPSET = 18
# The dynamo exporter emits opset 18 natively; other versions go through the ONNX version
# converter. These are the ones checked to convert and run on onnxruntime.
SUPPORTED_OPSETS = (18, 19, 20, 21)

_SYMBOL = re.compile(r"\bs\d+\b")


class DecoderAdapter(nn.Module):
    """GPT behind the flat I/O of the contract: (ids, mask, positions, *past) → (logits, *present).

    With a float16 KV cache the past is widened to float32 on entry and the present narrowed
    on exit, so the arithmetic (and the logits) stay float32 while the cache, the only tensor
    that grows with context, takes half the memory.
    """

    def __init__(self, gpt: GPT, kv_dtype: io.KvDtype = "float32") -> None:
        super().__init__()
        self.gpt = gpt
        self.kv_half = kv_dtype == "float16"

    def forward(
        self,
        input_ids: Tensor,  # (B, T) int64
        attention_mask: Tensor,  # (B, T_past + T) int64
        position_ids: Tensor,  # (B, T) int64
        *past: Tensor,  # 2 * n_layers tensors (B, nkv, T_past, hs)
    ) -> tuple[Tensor, ...]:
        pairs = [(past[2 * i].float(), past[2 * i + 1].float()) for i in range(len(past) // 2)]
        out = self.gpt(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       past_key_values=pairs)
        present = [t for kv in out.present for t in kv]  # 2 * n_layers (B, nh, T_past + T, hs)
        if self.kv_half:
            present = [t.half() for t in present]
        return (out.logits, *present)  # logits (B, T, vocab) float32


class AttentionAdapter(nn.Module):
    """GPT with intermediates: (ids, mask, positions) → per layer q, k, v, scores, scaled, α."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, input_ids: Tensor, attention_mask: Tensor,
                position_ids: Tensor) -> tuple[Tensor, ...]:
        out = self.gpt(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       return_intermediates=True)
        assert out.intermediates is not None
        flat: list[Tensor] = []
        for inter in out.intermediates:
            flat.extend(getattr(inter, kind) for kind in io.ATTENTION_KINDS)
        return tuple(flat)


def _example_decoder_inputs(gpt: GPT, kv_dtype: io.KvDtype) -> tuple[Tensor, ...]:
    """Non-degenerate example sizes (not 0 or 1, all distinct) so no axis gets specialised."""
    cfg = gpt.config
    b, t, p = 2, min(7, max(2, cfg.max_seq_len // 4)), min(5, max(2, cfg.max_seq_len // 4))
    ids = torch.randint(0, cfg.vocab_size, (b, t))
    mask = torch.ones(b, p + t, dtype=torch.long)
    pos = torch.arange(p, p + t).unsqueeze(0).expand(b, t).contiguous()
    dtype = torch.float16 if kv_dtype == "float16" else torch.float32
    past = [torch.zeros(b, cfg.kv_heads, p, cfg.head_dim, dtype=dtype)
            for _ in range(2 * cfg.n_layers)]
    return (ids, mask, pos, *past)


def _export(module: nn.Module, args: tuple[Tensor, ...], input_names: list[str],
            output_names: list[str], dynamic_shapes: dict[str, object],
            opset: int) -> onnx.ModelProto:
    module.eval()
    # The exporter logs a warning per missing torchvision op and prints progress lines.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    sink = _io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(sink), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module, args, f=None, input_names=input_names, output_names=output_names,
            dynamic_shapes=dynamic_shapes, dynamo=True, opset_version=opset,
            external_data=False, verbose=False)
    if program is None:
        raise RuntimeError("torch.onnx.export returned no program")
    proto: onnx.ModelProto = program.model_proto
    return proto


def _set_dims(value: onnx.ValueInfoProto, dims: list[str | int]) -> None:
    shape = value.type.tensor_type.shape
    if len(shape.dim) != len(dims):
        raise RuntimeError(f"{value.name}: rank {len(shape.dim)}, contract says {len(dims)}")
    for dim, new in zip(shape.dim, dims, strict=True):
        if isinstance(new, int):
            dim.dim_value = new
        else:
            dim.dim_param = new


def _rename_dims(proto: onnx.ModelProto, shapes: dict[str, dict[str, list[str]]],
                 static: dict[str, int]) -> None:
    """Give every graph input/output the contract's axis names; rename internal symbols too."""
    symbols: dict[str, str] = {}
    graph = proto.graph
    for section, values in (("inputs", graph.input), ("outputs", graph.output)):
        for value in values:
            contract = shapes[section][value.name]
            for dim, name in zip(value.type.tensor_type.shape.dim, contract, strict=True):
                if dim.dim_param and _SYMBOL.fullmatch(dim.dim_param):
                    symbols.setdefault(dim.dim_param, name)
            _set_dims(value, [static.get(n, n) for n in contract])
    for value in graph.value_info:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:
                dim.dim_param = _SYMBOL.sub(lambda m: symbols.get(m.group(0), m.group(0)),
                                            dim.dim_param)


def grouped_kv(cfg: GPTConfig) -> bool:
    """Whether the cache has fewer heads than the queries (grouped-query attention)."""
    return cfg.kv_heads != cfg.n_heads


def export_decoder(gpt: GPT, path: Path, opset: int = DEFAULT_OPSET,
                   kv_dtype: io.KvDtype = "float32") -> Path:
    """Write model.onnx: the merged prefill/decode graph with KV cache."""
    cfg = gpt.config
    n = cfg.n_layers
    batch = torch.export.Dim.DYNAMIC
    dyn: dict[str, object] = {
        "input_ids": {0: batch, 1: batch},
        "attention_mask": {0: batch, 1: batch},
        "position_ids": {0: batch, 1: batch},
        "past": tuple({0: batch, 2: batch} for _ in range(2 * n)),
    }
    gpt.set_attention_impl("matmul")  # fuses into FusedMatMul: no per-step copy of Kᵀ
    try:
        proto = _export(DecoderAdapter(gpt, kv_dtype), _example_decoder_inputs(gpt, kv_dtype),
                        io.model_input_names(n), io.model_output_names(n), dyn, opset)
    finally:
        gpt.set_attention_impl("sdpa")
    static = {"num_heads": cfg.n_heads, io.KV_HEADS: cfg.kv_heads, "head_dim": cfg.head_dim,
              "vocab_size": cfg.vocab_size}
    _rename_dims(proto, io.model_io_shapes(n, grouped_kv(cfg)), static)
    proto.doc_string = (f"attnserve decoder with KV cache; kv_dtype={kv_dtype}; "
                        "logits float32; I/O per service/contract/io_spec.py")
    onnx.save_model(proto, str(path))
    return path


def attention_io_shapes(n_layers: int) -> dict[str, dict[str, list[str]]]:
    """Symbolic shapes of attention.onnx (no cache: keys span the query sequence)."""
    seq = [io.BATCH, io.SEQUENCE]
    per_head = [io.BATCH, "num_heads", io.SEQUENCE, "head_dim"]
    square = [io.BATCH, "num_heads", io.SEQUENCE, io.SEQUENCE]
    outputs = {
        io.attention_output_name(i, k): per_head if k in ("q", "k", "v") else square
        for i in range(n_layers) for k in io.ATTENTION_KINDS
    }
    return {"inputs": {name: seq for name in io.attention_input_names()}, "outputs": outputs}


def export_attention(gpt: GPT, path: Path, opset: int = DEFAULT_OPSET) -> Path:
    """Write attention.onnx: every layer's intermediates for a whole (left-padded) prompt."""
    cfg = gpt.config
    b, t = 2, min(7, cfg.max_seq_len)
    ids = torch.randint(0, cfg.vocab_size, (b, t))
    mask = torch.ones(b, t, dtype=torch.long)
    pos = torch.arange(t).unsqueeze(0).expand(b, t).contiguous()
    dim = torch.export.Dim.DYNAMIC
    dyn: dict[str, object] = {name: {0: dim, 1: dim} for name in io.attention_input_names()}
    proto = _export(AttentionAdapter(gpt), (ids, mask, pos), io.attention_input_names(),
                    io.attention_output_names(cfg.n_layers), dyn, opset)
    static = {"num_heads": cfg.n_heads, "head_dim": cfg.head_dim}
    _rename_dims(proto, attention_io_shapes(cfg.n_layers), static)
    proto.doc_string = "attnserve attention introspection: q, k, v, scores, scaled_scores, weights"
    onnx.save_model(proto, str(path))
    return path
