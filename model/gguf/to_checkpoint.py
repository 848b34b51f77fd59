"""Import a GGUF file (llama.cpp's format) as an attnserve checkpoint.

Usage (through the CLI):
    attnserve import --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf --out checkpoints/smollm2

The file's metadata and tensors are read by model/gguf/reader.py. The checkpoint holds
the file itself as its weights (model.gguf): the quantised blocks, which ``--quantize
gguf`` keeps, and which loading the checkpoint dequantises (``HeldWeights``);
``float32=True`` (``--float32``) writes the dequantised float32 weights as
model.safetensors instead.
The tokenizer comes from the metadata (model/gguf/vocab.py), with the chat template,
tokenizer_config.json and generation_config.json written beside it for the chat route.

Everything is checked before anything is written, and the checkpoint is staged and
renamed into place, so a refused import (another architecture, a tensor type or option
we do not compute, a SentencePiece tokenizer, a truncated file) leaves nothing behind.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from model.architectures.base import Architecture
from model.checkpoint import CheckpointMeta, save_checkpoint
from model.config import GPTConfig
from model.gguf.reader import (
    _dequantized_state,
    _filled,
    file_sha256,
    open_gguf,
    plan_tensors,
    read_config,
)
from model.gguf.vocab import (
    GGUFVocab,
    build_tokenizer,
    checkpoint_special_ids,
    read_vocab,
    side_files,
)
from model.hf_import import ImportRefused, check_target, with_sampling


@dataclass(frozen=True)
class GGUFSource:
    """What an import reads, checked and ready to write."""

    path: Path
    reader: gguf.GGUFReader
    meta: dict[str, Any]
    config: GPTConfig
    arch: Architecture
    family: str  # general.architecture
    vocab: GGUFVocab
    tokenizer_json: str
    plan: list[tuple[gguf.ReaderTensor, list[str]]]  # each tensor and the names it fills
    skeleton: Any  # model.gpt.GPT of the config on the meta device (no storage)


def read_gguf_source(path: Path) -> GGUFSource:
    """Read and check everything an import needs; raise ImportRefused with one line."""
    from model.gpt import GPT
    from model.tokenizer import checkpoint_special_ids as check_ids

    def refuse(reason: str) -> ImportRefused:
        return ImportRefused(f"{path}: {reason}")

    reader = open_gguf(path)
    meta, family, arch, config = read_config(reader, path)
    vocab = read_vocab(meta, str(path))
    if len(vocab.tokens) > config.vocab_size:
        raise refuse(f"the tokenizer has {len(vocab.tokens)} tokens but token_embd.weight only "
                     f"{config.vocab_size} rows")
    tokenizer = build_tokenizer(vocab)
    try:
        check_ids(tokenizer, checkpoint_special_ids(vocab))
    except ValueError as exc:
        raise refuse(f"special token ids: {exc}") from exc
    with torch.device("meta"):  # shapes without storage (GPT's init is wasted here, once)
        skeleton = GPT(config)
    expected = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    plan = plan_tensors(reader.tensors, expected, config.tie_weights, arch, family, refuse)
    return GGUFSource(path, reader, meta, config, arch, family, vocab, tokenizer.to_str(), plan,
                      skeleton)


def state_dict_from_gguf(source: GGUFSource) -> dict[str, torch.Tensor]:
    """Every tensor dequantised once, renamed, in our layout (e.g. llama's Q/K rows
    unpermuted)."""
    return _dequantized_state(source.plan, source.arch, source.family, source.config)


# llama.cpp's general.sampling.* keys (a model author's recommended sampling) → the
# generation_config.json fields the service reads.
GGUF_SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                 "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
                 "general.sampling.penalty_repeat": "repetition_penalty"}


def import_gguf_checkpoint(src: Path, out: Path, *, force: bool = False,
                           sampling: dict[str, float | int] | None = None,
                           float32: bool = False) -> Path:
    """Convert the GGUF file ``src`` into our checkpoint at ``out`` (nothing written on refusal).

    By default the checkpoint holds the file itself as its weights (model.gguf: a hard
    link where the filesystem allows, else a copy): its quantised blocks, not a float32
    copy of every weight, which loading dequantises (model/checkpoint.py) and
    ``--quantize gguf`` keeps. ``float32`` writes model.safetensors instead (every tensor
    dequantised once). ``sampling`` (e.g. the model card's temperature) goes into
    generation_config.json over whatever the file's ``general.sampling.*`` keys recommend.
    """
    src, out = Path(src), Path(out)
    check_target(out, force)
    source = read_gguf_source(src)
    model = None
    if float32:
        model = _filled(source.skeleton, state_dict_from_gguf(source), source.config.tie_weights)
    else:  # a tensor cut short by a truncated file is refused before anything is written
        for tensor, _ in source.plan:
            if np.asarray(tensor.data).nbytes != int(tensor.n_bytes):
                raise ImportRefused(f"{src}: tensor {tensor.name} is cut short (truncated file)")
    file_type = source.meta.get("general.file_type")
    meta = CheckpointMeta(
        model=source.config,
        tokenizer={"kind": "bpe", **checkpoint_special_ids(source.vocab)},
        training={"imported_from": {
            "format": "gguf", "path": str(src.resolve()),
            # What --quantize gguf checks the file against before using its blocks.
            "size": int(source.reader.data.size), "sha256": file_sha256(source.reader),
            "architecture": source.meta["general.architecture"],
            "name": source.meta.get("general.name"),
            "file_type": (gguf.LlamaFileType(file_type).name
                          if file_type in {int(t) for t in gguf.LlamaFileType} else file_type),
            "tensor_types": dict(Counter(t.tensor_type.name for t in source.reader.tensors)),
            "tokenizer_pre": source.vocab.pre_name,
        }},
    )
    extra = side_files(source.vocab, source.config.max_seq_len)
    recommended = {field: source.meta[key] for key, field in GGUF_SAMPLING.items()
                   if source.meta.get(key) is not None}
    if recommended or sampling:
        extra["generation_config.json"] = with_sampling(extra["generation_config.json"],
                                                        {**recommended, **(sampling or {})})
    if model is not None:
        return save_checkpoint(out, model, meta, source.tokenizer_json, extra_files=extra)
    return save_checkpoint(out, None, meta, source.tokenizer_json, extra_files=extra,
                           gguf_file=src)
