"""A GGUF file rewritten with every tensor dequantised to f32: llama.cpp's f32 row on the
very weights our import reads from the same file.

The metadata (architecture, hyper-parameters, tokenizer, chat template) is copied key by
key, ``general.file_type`` becomes ALL_F32, and each tensor goes through
``gguf.quants.dequantize`` — the reference our importer is checked against — keeping its
name and (reversed) shape, so llama.cpp's own Q/K row layout is untouched. llama.cpp's
quantiser then makes q8_0 from this file (benchmarks/runner_llamacpp.py: ``quantize``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


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
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)
    return {"source_tensor_types": types, "bytes": dst.stat().st_size,
            "dequantize_s": time.perf_counter() - t0}
