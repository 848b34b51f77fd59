"""A GGUF file's metadata and tensors read as our model: what loading a checkpoint that
holds its GGUF file needs (model/checkpoint.py), and what the import builds on
(model/gguf/to_checkpoint.py), below both.

The file is read with the maintained ``gguf`` package (memory-mapped) for the
architectures we serve (``general.architecture`` ``llama``, ``qwen2``, ``qwen3``,
``smollm3``, ``phi3``, ``gemma3``, ``gpt2``: whatever model/architectures/ registers).
The metadata becomes the same Hugging Face-style config that model/hf_import.py reads
from config.json, so both importers build a GPTConfig through one set of checks
(model/hf_config.py). Tensors are dequantised one at a time with ``gguf.quants.dequantize``
(llama.cpp's own definitions) to float32 and renamed by the architecture's table of
llama.cpp names. GGUF lists dimensions innermost first; what else llama.cpp's converter
changed (llama's Q/K row permutation for its interleaved rotary) the architecture undoes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from model.architectures import for_gguf, gguf_names
from model.architectures.base import Architecture
from model.config import GPTConfig
from model.hf_config import ImportRefused, gpt_config_from_hf

Q = gguf.GGMLQuantizationType
SUPPORTED_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
                             Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K})
class _Reader(gguf.GGUFReader):
    """GGUFReader that names the tensor of an unknown type id, and reads string arrays (the
    vocabulary and merges: 98k strings for SmolLM2, 2.6 s of the stock reader's
    per-element memmap slicing) in a third of the time, into the same fields (a test
    compares them with the stock reader's)."""

    def _build_tensors(self, start_offs: int, fields: list[gguf.ReaderField]) -> None:
        known = {int(t) for t in Q}
        for field in fields:
            type_id = int(field.parts[4][0])
            if type_id not in known:
                raise ImportRefused(f"tensor {field.name} has unknown GGML type id {type_id}")
        super()._build_tensors(start_offs, fields)

    def _get_field_parts(self, orig_offs: int, raw_type: int
                         ) -> tuple[int, list[np.ndarray], list[int], list[gguf.GGUFValueType]]:
        string = gguf.GGUFValueType.STRING
        if raw_type != gguf.GGUFValueType.ARRAY or self._get(orig_offs, np.uint32)[0] != string:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        data = np.asarray(self.data)  # plain ndarray: slicing it costs no Python call
        length = np.dtype(np.uint64).newbyteorder(self.byte_order)
        parts: list[np.ndarray] = [raw_itype, count]
        offs = orig_offs + 12
        for _ in range(int(count[0])):
            size = data[offs:offs + 8].view(length)
            parts += [size, data[offs + 8:offs + 8 + int(size[0])]]
            offs += 8 + int(size[0])
        types = [gguf.GGUFValueType.ARRAY, string] if count[0] else [gguf.GGUFValueType.ARRAY]
        return offs - orig_offs, parts, list(range(3, len(parts), 2)), types


def open_gguf(path: Path) -> gguf.GGUFReader:
    """The memory-mapped reader, or a one-line refusal for anything that is not GGUF."""
    if not path.is_file():
        raise ImportRefused(f"{path} is not a file (expected a .gguf model file)")
    try:
        return _Reader(path)
    except ImportRefused as exc:
        raise ImportRefused(f"{path}: {exc}") from exc
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, OSError) as exc:
        # A truncated file ends a header read or a tensor's data early (short arrays).
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        raise ImportRefused(f"{path} is not a readable GGUF file (truncated or corrupt?): "
                            f"{reason}") from exc


def field_value(field: gguf.ReaderField) -> Any:
    """A metadata value as Python: str, int/float/bool, or a list of them."""
    types = field.types
    parts = [field.parts[i] for i in field.data]
    if types[0] == gguf.GGUFValueType.ARRAY:
        if len(types) < 2 or not parts:
            return []
        if types[1] == gguf.GGUFValueType.STRING:
            return [bytes(p).decode("utf-8") for p in parts]
        if types[1] == gguf.GGUFValueType.ARRAY:
            return None  # nested arrays: no key we read has them
        return np.concatenate(parts).tolist()
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(parts[0]).decode("utf-8")
    return parts[0].tolist()[0]


def read_metadata(reader: gguf.GGUFReader, where: Path) -> dict[str, Any]:
    try:
        return {key: field_value(field) for key, field in reader.fields.items()}
    except (UnicodeDecodeError, IndexError, ValueError) as exc:
        raise ImportRefused(f"{where}: corrupt metadata: {exc}") from exc


def hf_config_from_gguf(meta: dict[str, Any], arch: Architecture, family: str,
                        tensors: dict[str, gguf.ReaderTensor],
                        refuse: Callable[[str], ImportRefused]) -> dict[str, Any]:
    """The config.json transformers would compute for this file: the keys every family
    shares here, the rest from its architecture."""
    if "token_embd.weight" not in tensors:
        raise refuse("tensor token_embd.weight is missing")
    vocab_size = int(tensors["token_embd.weight"].shape[1])  # ne[1]: rows
    tied = "output.weight" not in tensors
    if meta.get(f"{family}.expert_count"):
        raise refuse(f"{family}.expert_count {meta[f'{family}.expert_count']}: "
                     "mixture-of-experts models are not supported")
    return {**arch.hf_config_from_gguf(meta, family, tensors, refuse, dequantize),
            "vocab_size": vocab_size, "tie_word_embeddings": tied}


def _numpy_shape(tensor: gguf.ReaderTensor) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))  # ne[0] is innermost


def plan_tensors(tensors: list[gguf.ReaderTensor], expected: dict[str, tuple[int, ...]],
                 tied: bool, arch: Architecture, family: str,
                 refuse: Callable[[str], ImportRefused]
                 ) -> list[tuple[gguf.ReaderTensor, list[str]]]:
    """Match every tensor to our parameters (``expected`` shapes) by name, type and shape,
    reading headers only."""
    plan, unexpected, filled = [], [], set()
    in_config = arch.gguf_config_tensors(family)  # e.g. Llama 3's rope_freqs
    for tensor in tensors:
        if tensor.name in in_config:
            continue
        if tensor.tensor_type not in SUPPORTED_TYPES:
            raise refuse(f"tensor {tensor.name} has type {tensor.tensor_type.name}, which is not "
                         f"supported (one of {', '.join(sorted(t.name for t in SUPPORTED_TYPES))})")
        targets = arch.gguf_targets(tensor.name, family)
        if targets is None or any(t not in expected for t in targets):
            unexpected.append(tensor.name)
            continue
        rows = sum(expected[t][0] for t in targets)
        want = (rows, *expected[targets[0]][1:])
        if _numpy_shape(tensor) != want:
            raise refuse(f"tensor {tensor.name} has shape {list(_numpy_shape(tensor))} (rows, "
                         f"columns), the metadata implies {list(want)}")
        plan.append((tensor, targets))
        filled.update(targets)
    missing = sorted(set(expected) - filled - ({"lm_head.weight"} if tied else set()))
    if missing or unexpected:
        raise refuse(f"tensors do not match a {family} model of this metadata: missing "
                     f"{missing[:4]}{' ...' if len(missing) > 4 else ''}, unexpected "
                     f"{unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}")
    return plan


def read_config(reader: gguf.GGUFReader, path: Path
                ) -> tuple[dict[str, Any], str, Architecture, GPTConfig]:
    """The file's metadata, ``general.architecture``, its registered architecture and the
    GPTConfig it computes (export/gguf/source.py rebuilds it for --quantize gguf); raise
    ImportRefused with one line."""
    def refuse(reason: str) -> ImportRefused:
        return ImportRefused(f"{path}: {reason}")

    if reader.byte_order != "I":  # its block scales would be read in the wrong byte order
        raise refuse("big-endian GGUF files are not supported")
    meta = read_metadata(reader, path)
    family = str(meta.get("general.architecture"))
    arch = for_gguf(family)
    if arch is None:
        raise refuse(f"general.architecture {meta.get('general.architecture')!r} is not "
                     f"supported; attnserve imports {', '.join(gguf_names())}")
    tensors = {t.name: t for t in reader.tensors}
    try:
        config = gpt_config_from_hf(hf_config_from_gguf(meta, arch, family, tensors, refuse),
                                    path)
    except ImportRefused:
        raise
    except (TypeError, ValueError) as exc:  # a metadata value of the wrong kind
        raise refuse(f"unsupported metadata: {exc}") from exc
    return meta, family, arch, config


def dequantize(tensor: gguf.ReaderTensor) -> torch.Tensor:
    """llama.cpp's dequantisation of one tensor, float32, in numpy's (rows, columns) order."""
    # np.asarray: a plain view of the memory map (numpy's memmap subclass costs a Python
    # call per slice, which doubled the time of the grouped-rows loop in gguf.quants).
    values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    if values.shape != _numpy_shape(tensor):
        raise ImportRefused(f"tensor {tensor.name} dequantised to {list(values.shape)}, its "
                            f"header says {list(_numpy_shape(tensor))}")
    # A copy: an F32 tensor is a view of the read-only memory map.
    return torch.from_numpy(np.require(values, np.float32, ["C", "W"]))


def _dequantized_entry(tensor: gguf.ReaderTensor, targets: list[str], arch: Architecture,
                       family: str, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """One GGUF tensor dequantised, in our layout, as the parameters it fills."""
    w = dequantize(tensor)  # (out, in) or (n,)
    w = arch.from_gguf_layout(w, targets[0], family, cfg)  # (out, in)
    if len(targets) == 1:
        return {targets[0]: w.contiguous()}
    rows = arch.split_rows(targets, cfg, w.shape[0])
    # a fused tensor's rows (Q, K, V): own storage each
    return {t: part.clone() for t, part in zip(targets, w.split(rows), strict=True)}


def _dequantized_state(plan: list[tuple[gguf.ReaderTensor, list[str]]], arch: Architecture,
                       family: str, cfg: GPTConfig,
                       wanted: Callable[[str], bool] = lambda _: True
                       ) -> dict[str, torch.Tensor]:
    """The ``wanted`` parameters of ``plan``, dequantised one tensor at a time (a tensor
    none of whose parameters is wanted is not read); a tied head's weight is the
    embedding's."""
    out: dict[str, torch.Tensor] = {}
    for tensor, targets in plan:
        if any(map(wanted, targets)):
            out.update(_dequantized_entry(tensor, targets, arch, family, cfg))
    if cfg.tie_weights and "tok_emb.weight" in out:
        out["lm_head.weight"] = out["tok_emb.weight"]
    return {k: v for k, v in out.items() if wanted(k)}


class HeldWeights:
    """A checkpoint's GGUF file as a source of its parameters, dequantised on demand.

    What a model of 1-3 B parameters needs so that no step holds all its weights in float32
    (a 1B model's are 4.3 GB): :meth:`model` with ``leave`` fills the model's
    small tensors and leaves the matrices of those GGUF types on the meta device, the
    export builds its graphs from the file's blocks (export/gguf/blocks.py), and a
    reference that needs the values runs the layers one at a time, each one's weights
    dequantised for it and dropped after (:meth:`filled`; export/verify/layerwise.py).
    """

    def __init__(self, path: Path, config: GPTConfig) -> None:
        from model.gpt import GPT

        def refuse(reason: str) -> ImportRefused:
            return ImportRefused(f"{path}: {reason}")

        self.path, self.config = path, config
        self.reader = open_gguf(path)
        _, self.family, self.arch, found = read_config(self.reader, path)
        if found.to_dict() != config.to_dict():
            raise refuse("its metadata computes another model than the checkpoint's config.json")
        with torch.device("meta"):
            self.skeleton = GPT(config)
        expected = {k: tuple(v.shape) for k, v in self.skeleton.state_dict().items()}
        self.plan = plan_tensors(self.reader.tensors, expected, config.tie_weights, self.arch,
                                 self.family, refuse)

    def state(self, prefix: str = "", leave: frozenset[Any] = frozenset(),
              where: Callable[[str], bool] = lambda _: True) -> dict[str, torch.Tensor]:
        """The parameters whose names start with ``prefix`` and satisfy ``where``,
        dequantised one tensor at a time, but for those of tensors of the GGUF types in
        ``leave``; a tied head's weight is the embedding's."""
        plan = [(tensor, targets) for tensor, targets in self.plan
                if tensor.tensor_type not in leave]
        return _dequantized_state(plan, self.arch, self.family, self.config,
                                  lambda name: name.startswith(prefix) and where(name))

    def model(self, leave: frozenset[Any] = frozenset()) -> Any:
        """The model.gpt.GPT with every weight dequantised into it, but for the tensors of
        the GGUF types in ``leave``, which stay on the meta device (no storage)."""
        return _filled(self.skeleton, self.state(leave=leave), self.config.tie_weights,
                       strict=not leave)

    def fill(self, model: Any, prefix: str, where: Callable[[str], bool] = lambda _: True
             ) -> list[str]:
        """Give ``model``'s parameters under ``prefix`` that are on the meta device and
        satisfy ``where`` their values; the names of those filled."""
        state = self.state(prefix, where=lambda k: model.get_parameter(k).is_meta and where(k))
        model.load_state_dict(state, strict=False, assign=True)
        if self.config.tie_weights:
            model.lm_head.weight = model.tok_emb.weight
        return list(state)

    def close(self) -> None:
        """Let the file's memory map go (the tensors read from it hold views of it): its
        pages stop counting in the process's resident set. Nothing can be read after."""
        self.plan.clear()
        del self.reader

    @contextmanager
    def filled(self, model: Any, prefix: str) -> Iterator[None]:
        """Within the block, ``model``'s parameters under ``prefix`` (e.g. ``blocks.3.``)
        hold their values; after it, those that came from a left tensor are on the meta
        device again (their memory given back)."""
        state = self.fill(model, prefix)
        try:
            yield
        finally:
            for name in state:
                module_name, _, attr = name.rpartition(".")
                module = model.get_submodule(module_name)
                setattr(module, attr, torch.nn.Parameter(
                    torch.empty_like(getattr(module, attr), device="meta"),
                    requires_grad=False))
            if self.config.tie_weights:
                model.lm_head.weight = model.tok_emb.weight


def _filled(skeleton: Any, state: dict[str, torch.Tensor], tied: bool,
            strict: bool = True) -> Any:
    """The meta-device GPT with ``state`` as its parameters (no copy), tied again;
    ``strict=False``: those missing from ``state`` stay on the meta device."""
    skeleton.load_state_dict(state, strict=strict, assign=True)
    if tied:
        skeleton.lm_head.weight = skeleton.tok_emb.weight  # assign=True untied them
    skeleton.fill_buffers()
    return skeleton.eval()


def file_sha256(reader: gguf.GGUFReader) -> str:
    """The sha256 of the whole file, hashed from the reader's memory map: the pages the
    dequantisation just read, so no second read from disk (0.1 s for SmolLM2's 93 MB)."""
    return hashlib.sha256(np.asarray(reader.data).data).hexdigest()  # a view, no copy
