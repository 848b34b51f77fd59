"""The f32 GGUF files llama.cpp's f32 rows run: the same weights our engine computes with.

``write_gguf``: the transformers GPT-2 directory written as GGUF, the way llama.cpp
converts it. This follows llama.cpp's own recipe for ``GPT2LMHeadModel``
(vendor/llama.cpp/conversion/gpt2.py in the llama-cpp-python sdist): Conv1D weights (in,
out) transposed to (out, in), names through gguf's tensor-name map for the GPT2
architecture, the causal-mask buffers dropped, the tied LM head left to token_embd, and
the tokenizer as a ``gpt2`` BPE with its merges and special ids from gguf.SpecialVocab.
Its converter script cannot be used as is: it identifies the pre-tokenizer by hashing the
output of known tokenizers, and a tokenizer trained here is not one of them, so ``gpt-2``
is named explicitly. q8_0 is made from this file by llama.cpp's own quantiser
(benchmarks/lib/runner_llamacpp.py).

``dequantize_gguf``: a GGUF file rewritten with every tensor dequantised to f32, llama.cpp's
f32 row on the very weights our import reads from the same file. The metadata
(architecture, hyper-parameters, tokenizer, chat template) is copied key by key,
``general.file_type`` becomes ALL_F32, and each tensor goes through
``gguf.quants.dequantize`` (the reference our importer is checked against), keeping its
name and (reversed) shape, so llama.cpp's own Q/K row layout is untouched. llama.cpp's
quantiser then makes q8_0 from this file (benchmarks/lib/runner_llamacpp.py: ``quantize``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def write_gguf(hf_dir: Path, out: Path) -> dict[str, Any]:
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    hp = json.loads((hf_dir / "config.json").read_text("utf-8"))
    n_layer, n_embd = int(hp["n_layer"]), int(hp["n_embd"])
    arch = gguf.MODEL_ARCH.GPT2
    names = gguf.get_tensor_name_map(arch, n_layer)
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name("attnserve-bench-gpt2")
    writer.add_block_count(n_layer)
    writer.add_context_length(int(hp["n_ctx"] if "n_ctx" in hp else hp["n_positions"]))
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(int(hp.get("n_inner") or 4 * n_embd))
    writer.add_head_count(int(hp["n_head"]))
    writer.add_layer_norm_eps(float(hp["layer_norm_epsilon"]))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    vocab: dict[str, int] = json.loads((hf_dir / "vocab.json").read_text("utf-8"))
    size = int(hp["vocab_size"])
    tokens = [""] * size
    for tok, i in vocab.items():
        tokens[i] = tok
    special = {int(hp["eos_token_id"]), int(hp["bos_token_id"])}
    types = [gguf.TokenType.CONTROL if i in special else
             gguf.TokenType.UNUSED if t.startswith("<|unused") else gguf.TokenType.NORMAL
             for i, t in enumerate(tokens)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(hf_dir, load_merges=True).add_to_gguf(writer)

    weights = load_file(str(hf_dir / "model.safetensors"))
    written = 0
    for name, data in weights.items():
        if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
            continue  # causal-mask buffers; the LM head is tied to the token embedding
        if name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            data = data.T  # Conv1D (in, out) → (out, in)
        key = name.removeprefix("transformer.")
        new = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ValueError(f"no GGUF name for tensor {name!r}")
        writer.add_tensor(new, np.ascontiguousarray(data, dtype=np.float32))
        written += 1
    _finish(writer)
    return {"tensors": written, "bytes": out.stat().st_size, "gguf_version": _version()}


def dequantize_gguf(src: Path, dst: Path) -> dict[str, Any]:
    """Write ``dst``: ``src`` with f32 tensors; returns counts, bytes and seconds."""
    import gguf
    import numpy as np

    t0 = time.perf_counter()
    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture",
                                                             "general.file_type"):
            continue  # written by the writer itself, or changed below
        kind = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[-1]) if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    types: dict[str, int] = {}
    for tensor in reader.tensors:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # numpy (outer … inner)
        types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
        writer.add_tensor(tensor.name, np.ascontiguousarray(data, dtype=np.float32))
    _finish(writer)
    os.replace(tmp, dst)
    return {"source_tensor_types": types, "bytes": dst.stat().st_size,
            "dequantize_s": time.perf_counter() - t0}


def _finish(writer: Any) -> None:
    """Header, key-values, tensors, in the order gguf's writer requires; then close."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("gguf")
    except metadata.PackageNotFoundError:
        return "?"
