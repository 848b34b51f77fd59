"""`attnserve export --adapter DIR --ckpt BASE --format gguf`: a LoRA adapter for llama.cpp.

Usage:
    attnserve export --adapter adapters/mine --ckpt checkpoints/smollm2 --format gguf \\
        --out mine-lora.gguf
    llama-server -m smollm2.gguf --lora mine-lora.gguf

llama.cpp's adapter layout, as its ``convert_lora_to_gguf.py`` writes it:
``general.type`` adapter, ``general.architecture`` the base's, ``adapter.type`` lora,
``adapter.lora.alpha``, and per adapted base tensor ``<tensor>.lora_a`` (r, in) and
``<tensor>.lora_b`` (out, r), named after the base file's tensor and with its rows in the
base file's order (the Q/K permutation of llama-type rotary applies to ``lora_b``;
transformers' fused modules and llama.cpp's fused tensors line up: Phi-3's qkv_proj and
attn_qkv, GPT-2's c_attn). llama.cpp scales every pair by alpha / r, r from its tensors:
the adapter's own scale is kept exactly by writing alpha = scale·r (rsLoRA's alpha/√r
included), and a module whose scale differs (PEFT's ``alpha_pattern``, rsLoRA over mixed
ranks) has the difference folded into its ``lora_b``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from export.gguf.layout import (
    GGUFOutRefused,
    check_out,
    file_rows,
    numpy_shape,
    source_file,
)
from model.architectures import architecture
from model.checkpoint import read_meta
from service.contract.atomic_gguf import write_atomically

ADAPTER_TYPES = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
                 "bf16": gguf.GGMLQuantizationType.BF16}


def base_layout(ckpt_dir: Path) -> tuple[str, dict[str, Any], dict[str, tuple[int, ...]]]:
    """(llama.cpp family, our parameter → its GGUF rows, file tensor shapes) of the base as
    a GGUF file: the file it holds or descends from, else the file `export --format gguf`
    writes for it."""
    from model.gguf.reader import open_gguf, read_config

    meta = read_meta(ckpt_dir)
    source = source_file(ckpt_dir, meta.training)
    if source is not None:
        reader = open_gguf(source)
        _, family, arch, config = read_config(reader, source)
        shapes = {t.name: numpy_shape(t) for t in reader.tensors}
        return family, arch.gguf_sources(family, config, file_rows(reader)), shapes
    from export.gguf.metadata import family_of, planned_shapes

    config = meta.model
    arch = architecture(config.arch)
    family = family_of(config)
    state = _shapes_only(config)
    shapes = planned_shapes(arch, family, config, state)
    return family, arch.gguf_sources(family, config, {n: s[0] for n, s in shapes.items()}), \
        shapes


def _shapes_only(config: Any) -> dict[str, Any]:
    """Our parameters' shapes (no values: a model built on the meta device), all a LoRA's
    rows need."""
    import torch

    from model.gpt import GPT

    with torch.device("meta"):
        model = GPT(config)
    return {k: np.broadcast_to(np.float32(0), tuple(v.shape))
            for k, v in model.state_dict().items()}


def export_gguf_adapter(adapter_dir: str | os.PathLike[str], ckpt_dir: str | os.PathLike[str],
                        out: str | os.PathLike[str], outtype: str | None = None,
                        force: bool = False) -> Path:
    """Write the PEFT LoRA adapter ``adapter_dir`` for the base ``ckpt_dir`` as llama.cpp's
    adapter file ``out``; return its path."""
    from model.finetune.peft_format import read_adapter

    adapter_dir, ckpt_dir, out = Path(adapter_dir), Path(ckpt_dir), Path(out)
    check_out(out, force)
    kind = ADAPTER_TYPES.get(outtype or "f32")
    if kind is None:
        raise GGUFOutRefused(f"--outtype {outtype!r} for an adapter: one of "
                             f"{', '.join(ADAPTER_TYPES)}")
    meta = read_meta(ckpt_dir)
    adapter = read_adapter(adapter_dir, meta.model)
    family, sources, shapes = base_layout(ckpt_dir)
    loras = adapter.each()
    alpha = loras[0].scale * loras[0].lora_A.shape[0]  # llama.cpp: scale = alpha / r
    pairs: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for lora in loras:
        a = lora.lora_A.detach().float().numpy()  # (r, in)
        b = lora.lora_B.detach().float().numpy() * (lora.scale * a.shape[0] / alpha)  # (out, r)
        start = 0
        for part in lora.target.ours:
            source = sources.get(f"{part}.weight")
            if source is None:
                raise GGUFOutRefused(f"{part}.weight has no tensor in the base's GGUF file")
            rows = len(source.rows)
            tensor = pairs.setdefault(source.tensor, (a, np.zeros(
                (shapes[source.tensor][0], a.shape[0]), np.float32)))
            if tensor[0] is not a and not np.array_equal(tensor[0], a):
                raise GGUFOutRefused(f"{source.tensor} would take two different LoRA A's")
            tensor[1][source.rows] = b[start:start + rows]
            start += rows

    def write(path: Path) -> gguf.GGUFWriter:
        writer = gguf.GGUFWriter(str(path), family)
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
        writer.add_name(out.stem)
        writer.add_description(f"LoRA adapter {adapter_dir.name} written by attnserve export "
                               "--format gguf")
        for tensor, (a, b) in pairs.items():
            for suffix, data in (("lora_a", a), ("lora_b", b)):
                data = np.ascontiguousarray(data, np.float32)
                if kind != gguf.GGMLQuantizationType.F32:
                    data = gguf.quants.quantize(data, kind)
                writer.add_tensor(f"{tensor}.{suffix}", data,
                                  raw_dtype=None if kind in (gguf.GGMLQuantizationType.F32,
                                                             gguf.GGMLQuantizationType.F16)
                                  else kind)
        return writer

    return write_atomically(write, out)
