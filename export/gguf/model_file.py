"""`attnserve export --format gguf`: a checkpoint as a llama.cpp GGUF file.

Usage:
    attnserve export --ckpt checkpoints/smollm2-demo --format gguf --out smollm2-demo.gguf
    attnserve export --ckpt CKPT --format gguf --out model-q8_0.gguf --outtype q8_0

What llama.cpp, ollama and LM Studio run. The tensors are llama.cpp's (names, the Q/K row
order of llama-type rotary, fused tensors, a tied head left out: export/gguf/layout.py).
With no ``--outtype`` a checkpoint that holds its GGUF file is written back with the file's
own blocks, byte for byte, and any other is written from its float weights as F32;
``--outtype`` re-encodes every matrix with gguf's own quantisers (f16, bf16, q8_0, q5_1,
q5_0, q4_1, q4_0; a matrix whose rows the type's blocks do not divide stays F16, as
llama.cpp's converter does; vectors stay F32; under the 4- and 5-bit types the output head
stays Q8_0, as llama-quantize keeps it). llama.cpp's K-quants come from this file with its
own ``llama-quantize``.

The metadata of a model that was a GGUF file (imported, or fine-tuned or merged from an
import) is that file's: every hyper-parameter and the tokenizer (``tokenizer.ggml.*``, with
its ``pre``, merges or SentencePiece scores, special ids, chat template) as llama.cpp wrote
them, so nothing is re-derived; ``general.*`` says what this file is and what it came from.
Any other checkpoint's comes from its config and tokenizer.json
(export/gguf/metadata.py). The file is written beside its target and renamed into place.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from export.gguf.layout import (
    FILE_TYPES,
    NARROW,
    OUTTYPES,
    GGUFOutRefused,
    TensorLayout,
    assemble,
    check_out,
    encode,
    file_rows,
    kind_for,
    layouts,
    numpy_shape,
    source_file,
)
from model.checkpoint import GGUF_WEIGHTS_FILE, read_meta
from service.contract.atomic_gguf import write_atomically

Q = gguf.GGMLQuantizationType
# general.* keys a written file sets itself (the rest of the source's general.* is kept)
OWN_GENERAL = ("general.file_type", "general.quantization_version", "general.name",
               "general.description", "general.base_model.")


def copy_metadata(writer: gguf.GGUFWriter, reader: gguf.GGUFReader) -> None:
    """Every key of ``reader`` but general.architecture and those starting with
    ``OWN_GENERAL``, with its own value type."""
    from model.gguf.reader import field_value

    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "general.architecture")) or key.startswith(OWN_GENERAL):
            continue
        kinds = field.types
        sub = kinds[1] if kinds[0] == gguf.GGUFValueType.ARRAY and len(kinds) > 1 else None
        if sub == gguf.GGUFValueType.ARRAY:
            raise GGUFOutRefused(f"metadata key {key} holds nested arrays, which are not "
                                 "copied")
        writer.add_key_value(key, field_value(field), kinds[0], sub)


def export_gguf(ckpt_dir: str | os.PathLike[str], out: str | os.PathLike[str],
                outtype: str | None = None, force: bool = False,
                log: Any = None) -> Path:
    """Write the checkpoint ``ckpt_dir`` as the GGUF file ``out``; return its path."""
    ckpt_dir, out = Path(ckpt_dir), Path(out)
    say = log or (lambda _message: None)
    check_out(out, force)
    if outtype is not None and outtype not in OUTTYPES:
        raise GGUFOutRefused(f"--outtype {outtype!r}: one of {', '.join(OUTTYPES)}")
    meta = read_meta(ckpt_dir)
    source = source_file(ckpt_dir, meta.training)
    if source is None:
        from export.gguf.metadata import export_generated

        return export_generated(ckpt_dir, meta, out, outtype, say)
    from model.gguf.reader import open_gguf, read_config

    reader = open_gguf(source)
    _, family, arch, config = read_config(reader, source)
    if config.to_dict() != meta.model.to_dict():
        raise GGUFOutRefused(f"{source} computes another model than {ckpt_dir}'s config.json")
    held = source == ckpt_dir / GGUF_WEIGHTS_FILE
    if held and outtype is None:  # the file's own blocks, as they are
        say(f"writing {source}'s own blocks")
        return write_atomically(lambda tmp: _write(reader, family, tmp, None, {}, out), out)
    from model.checkpoint import load_checkpoint

    weights = {k: v.detach().float().numpy() for k, v in
               load_checkpoint(ckpt_dir).model.state_dict().items()}
    sources = arch.gguf_sources(family, config, file_rows(reader))
    shapes = {t.name: numpy_shape(t) for t in reader.tensors}
    planned = {layout.name: layout for layout in layouts(sources, shapes, config.tie_weights)}
    kind = OUTTYPES[outtype or "f32"]
    if not held and kind in NARROW:  # a fine-tune or merge over the file's model
        say(f"note: a fine-tune's update is small beside a {kind.name} step and rounding to it "
            "can undo it (SmolLM2's demo written as q4_1 forgot all ten facts it was taught); "
            "q8_0, or the base file with the adapter (--adapter), keeps it: docs/export.md")
    say(f"writing {len(planned)} tensors from the checkpoint's weights as "
        f"{kind.name} over {source}'s metadata")
    return write_atomically(
        lambda tmp: _write(reader, family, tmp, kind, {"layouts": planned, "weights": weights},
                           out), out)


def _write(reader: gguf.GGUFReader, family: str, path: Path, kind: Q | None,
           values: dict[str, Any], out: Path) -> gguf.GGUFWriter:
    """The file's writer: the source's metadata, then every tensor of the source in order:
    copied as it is (``kind`` None, or a tensor none of our parameters fills: Llama 3's
    rope_freqs, Phi-3's rope factors), else assembled from our weights and encoded."""
    writer = gguf.GGUFWriter(str(path), family)
    writer.add_name(out.stem)
    name = reader.fields.get("general.name")
    if name is not None:
        writer.add_base_model_count(1)
        writer.add_base_model_name(0, str(name.contents()))
    writer.add_description("written by attnserve export --format gguf")
    copy_metadata(writer, reader)
    planned: dict[str, TensorLayout] = values.get("layouts", {})
    kinds = []
    names = {tensor.name for tensor in reader.tensors}
    for tensor in reader.tensors:
        layout = planned.get(tensor.name) if kind is not None else None
        if layout is None:  # raw bytes (quantised: uint8 rows) and the file's own type
            writer.add_tensor(tensor.name, np.asarray(tensor.data),
                              raw_dtype=tensor.tensor_type)
            kinds.append(tensor.tensor_type)
            continue
        assert kind is not None
        data, used = encode(assemble(layout, values["weights"]),
                            kind_for(tensor.name, kind, names))
        writer.add_tensor(tensor.name, data, raw_dtype=None if used in (Q.F32, Q.F16)
                          else used)
        kinds.append(used)
    file_type = reader.fields.get("general.file_type")
    if kind is None and file_type is not None:
        writer.add_file_type(int(file_type.contents()))
    else:
        writer.add_file_type(int(FILE_TYPES[kind or Q.F32]))
    if any(k not in (Q.F32, Q.F16, Q.BF16) for k in kinds):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    return writer
