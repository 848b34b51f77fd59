"""Import a local Hugging Face GPT-2 or Llama-family directory as an attnserve checkpoint.

Usage (through the CLI):
    attnserve import --hf models/distilgpt2 --out checkpoints/distilgpt2
    attnserve import --hf models/SmolLM2-135M-Instruct --out checkpoints/smollm2

Reads ``config.json`` (a ``model_type`` some architecture in model/architectures/
imports: gpt2, llama, qwen2), ``model.safetensors`` (or the
shards a ``model.safetensors.index.json`` lists), the tokenizer as ``tokenizer.json`` or
``vocab.json`` + ``merges.txt``, and ``generation_config.json`` when present, and writes
our checkpoint directory (config.json, model.safetensors, tokenizer.json) atomically,
with the chat template (``chat_template.jinja``), ``tokenizer_config.json`` and
``generation_config.json`` copied beside them for the chat route.

Everything is checked before anything is written, so a refused import leaves nothing
behind: pickled weights (``pytorch_model.bin``) are never opened, and configuration
options our model does not compute (layer-scaled attention, cross-attention, pruned
heads, other activations ...) are refused rather than converted into a different
network. The names, layouts and config mapping are each architecture's own; this
module reads, checks and writes, the same for every family.

transformers is not needed; nothing is downloaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model.architectures import architecture
from model.architectures.base import Architecture
from model.checkpoint import CheckpointMeta, save_checkpoint
from model.config import GPTConfig
from model.hf_config import (
    ImportRefused,
    gpt_config_from_hf,
    text_model_config,
    text_weight_name,
)

HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"
HF_WEIGHTS_INDEX = "model.safetensors.index.json"
HF_TOKENIZER = "tokenizer.json"
HF_VOCAB = "vocab.json"
HF_MERGES = "merges.txt"
HF_TOKENIZER_CONFIG = "tokenizer_config.json"
HF_SPECIAL_TOKENS_MAP = "special_tokens_map.json"
HF_GENERATION_CONFIG = "generation_config.json"
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.ckpt",
                   "tf_model.h5", "flax_model.msgpack")
ENDOFTEXT = "<|endoftext|>"
# Copied as they are: what the service reads from an artifact besides our own files.
CARRIED_FILES = ("generation_config.json", "tokenizer_config.json", "chat_template.jinja")

SAFETENSORS_HINT = (
    "convert it once with transformers: GPT2LMHeadModel.from_pretrained(DIR)"
    ".save_pretrained(DIR, safe_serialization=True), or download the model's "
    "model.safetensors (e.g. `hf download gpt2 model.safetensors --local-dir DIR`)")


# Sampling fields a model author may recommend in generation_config.json, with the range
# each must lie in (the service applies them to OpenAI requests that leave them out).
SAMPLING_FIELDS: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "top_k": (0, 1 << 30),
    "min_p": (0.0, 1.0), "repetition_penalty": (0.0, 10.0)}


def parse_sampling(pairs: list[str]) -> dict[str, float | int]:
    """``["temperature=0.2", "top_p=0.9"]`` → checked values; ImportRefused names the bad one."""
    values: dict[str, float | int] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or key not in SAMPLING_FIELDS:
            raise ImportRefused(f"--sampling {pair!r}: expected KEY=VALUE with KEY one of "
                                f"{sorted(SAMPLING_FIELDS)}")
        low, high = SAMPLING_FIELDS[key]
        try:
            value: float | int = int(raw) if key == "top_k" else float(raw)
        except ValueError:
            raise ImportRefused(f"--sampling {pair!r}: {raw!r} is not a number") from None
        if not low <= value <= high or (key in ("top_p", "repetition_penalty") and value == 0):
            raise ImportRefused(f"--sampling {pair!r}: {key} must lie in "
                                f"{'(' if key in ('top_p', 'repetition_penalty') else '['}"
                                f"{low:g}, {high:g}]")
        values[key] = value
    return values


def with_sampling(generation_config: bytes | None, sampling: dict[str, float | int]) -> bytes:
    """generation_config.json with ``sampling`` written over it (the author's defaults)."""
    data = json.loads(generation_config) if generation_config else {}
    data.update(sampling)
    return (json.dumps(data, indent=2) + "\n").encode()


@dataclass(frozen=True)
class HFSource:
    """What an import reads, checked and ready to write."""

    config: GPTConfig
    hf_config: dict[str, Any]  # a multimodal model's: its text model's
    weight_files: dict[str, Path]  # HF tensor name → safetensors file holding it
    prefix: str  # "transformer." or "" (checkpoints saved from GPT2Model)
    tokenizer_json: str
    special: dict[str, int | None]
    # a multimodal model's text weights: the causal LM's name → the name in the file
    stored_names: dict[str, str]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ImportRefused(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ImportRefused(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _optional_json(path: Path) -> dict[str, Any]:
    return _read_json(path) if path.is_file() else {}


def _weight_files(src: Path) -> dict[str, Path]:
    """Tensor name → file, from model.safetensors or the sharded index; pickle is refused."""
    from safetensors import SafetensorError, safe_open

    single, index = src / HF_WEIGHTS, src / HF_WEIGHTS_INDEX
    if index.is_file() and not single.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ImportRefused(f"{index} has no weight_map")
        files: dict[str, Path] = {}
        for name, shard in weight_map.items():
            path = src / str(shard)
            if Path(str(shard)).name != str(shard) or not path.is_file():
                raise ImportRefused(f"{index} names shard {shard!r}, which is not a file "
                                    f"in {src}")
            files[str(name)] = path
        return files
    if not single.is_file():
        pickled = [n for n in PICKLED_WEIGHTS if (src / n).exists()]
        if pickled:
            raise ImportRefused(
                f"{src / pickled[0]} is not safetensors; attnserve never loads pickled or "
                f"framework-specific weights: {SAFETENSORS_HINT}")
        raise ImportRefused(f"{src} has no {HF_WEIGHTS}: {SAFETENSORS_HINT}")
    try:
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}  # noqa: SIM118 (not a dict)
    except (SafetensorError, OSError) as exc:
        raise ImportRefused(f"{single} is not a readable safetensors file: {exc}") from exc


def _text_weights(files: dict[str, Path]) -> tuple[dict[str, Path], dict[str, str]]:
    """A multimodal model's files by its text model's tensor names (the other towers' left
    out), and those names → the names in the files."""
    text: dict[str, Path] = {}
    stored: dict[str, str] = {}
    for name, path in files.items():
        ours = text_weight_name(name)
        if ours is not None:
            text[ours], stored[ours] = path, name
    return text, stored


def _check_weights(files: dict[str, Path], config: GPTConfig, where: Path,
                   stored: dict[str, str]) -> str:
    """Check names and shapes against the config (headers only); return the name prefix."""
    from safetensors import safe_open

    arch = architecture(config.arch)
    names = [n for n in files if not n.endswith(arch.hf_ignored_suffixes)]
    prefix = arch.hf_prefix(names)
    expected = arch.hf_expected_shapes(config, prefix)
    head = "lm_head.weight"
    if not config.tie_weights:
        expected[head] = (config.vocab_size, config.d_model)
    present = set(names)
    missing = sorted(set(expected) - present)
    extra = sorted(present - set(expected) - {head})
    if missing or extra:
        raise ImportRefused(
            f"{where}: weights do not match a {arch.hf_class} of this config.json: "
            f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}, unexpected "
            f"{extra[:4]}{' ...' if len(extra) > 4 else ''}")
    by_file: dict[Path, list[str]] = {}
    for name in [*expected, *([head] if head in present else [])]:
        by_file.setdefault(files[name], []).append(name)
    for path, tensor_names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for name in tensor_names:
                sl = f.get_slice(stored.get(name, name))
                shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
                want = expected.get(name, (config.vocab_size, config.d_model))
                if shape != want:
                    raise ImportRefused(f"{path}: {name} has shape {list(shape)}, config.json "
                                        f"implies {list(want)}")
                if dtype not in ("F32", "F16", "BF16"):
                    raise ImportRefused(f"{path}: {name} is {dtype}; only float32/float16/"
                                        "bfloat16 weights can be imported")
    return prefix


def _special_token_names(src: Path) -> dict[str, str]:
    """bos/eos/pad/unk token strings from tokenizer_config.json and special_tokens_map.json."""
    names: dict[str, str] = {}
    for path in (src / HF_TOKENIZER_CONFIG, src / HF_SPECIAL_TOKENS_MAP):
        data = _optional_json(path)
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = data.get(key)
            if isinstance(value, dict):  # serialized AddedToken
                value = value.get("content")
            if isinstance(value, str) and key not in names:
                names[key] = value
    return names


def build_gpt2_tokenizer(vocab_file: Path, merges_file: Path, add_prefix_space: bool = False,
                         specials: tuple[str, ...] = (ENDOFTEXT,)) -> Any:
    """The byte-level BPE tokenizer GPT2TokenizerFast builds from vocab.json + merges.txt."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    try:
        bpe = models.BPE.from_file(str(vocab_file), str(merges_file))
    except Exception as exc:  # tokenizers raises bare Exceptions on malformed files
        raise ImportRefused(f"{vocab_file} / {merges_file} are not a BPE vocabulary: "
                            f"{exc}") from exc
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in specials if tokenizer.token_to_id(t) is not None])
    return tokenizer


def _load_tokenizer(src: Path, names: dict[str, str], arch: Architecture) -> Any:
    from tokenizers import Tokenizer

    if arch.hf_tokenizer_json_only and not (src / HF_TOKENIZER).is_file():
        # Their vocab.json/merges.txt or tokenizer.model need the model's own pre-tokenizer
        # and normaliser, which only tokenizer.json spells out.
        raise ImportRefused(f"{src} has no {HF_TOKENIZER}; {arch.name}-family models are "
                            "imported with their tokenizer.json (the fast tokenizer)")
    if (src / HF_TOKENIZER).is_file():
        try:
            return Tokenizer.from_file(str(src / HF_TOKENIZER))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
            raise ImportRefused(f"{src / HF_TOKENIZER} is not a valid tokenizer: {exc}") from exc
    if (src / HF_VOCAB).is_file() and (src / HF_MERGES).is_file():
        tok_config = _optional_json(src / HF_TOKENIZER_CONFIG)
        specials = tuple(dict.fromkeys([*names.values(), ENDOFTEXT]))
        return build_gpt2_tokenizer(src / HF_VOCAB, src / HF_MERGES,
                                    bool(tok_config.get("add_prefix_space", False)), specials)
    raise ImportRefused(f"{src} has no tokenizer: need {HF_TOKENIZER}, or {HF_VOCAB} and "
                        f"{HF_MERGES}")


def _special_ids(src: Path, hf: dict[str, Any], tokenizer: Any,
                 names: dict[str, str]) -> dict[str, int | None]:
    """bos/eos/pad ids: generation_config.json, else config.json, else the tokenizer's names.

    GPT-2 declares bos = eos = 50256 and no pad token; a pad of None stays None (the
    engine pads with any id and masks it).
    """
    generation = _optional_json(src / HF_GENERATION_CONFIG)
    ids: dict[str, int | None] = {}
    for kind in ("bos", "eos", "pad"):
        key = f"{kind}_token_id"
        value = generation.get(key, hf.get(key))
        if isinstance(value, list):  # several stop ids: ours stops at the first
            value = value[0] if value else None
        if value is None and f"{kind}_token" in names:
            value = tokenizer.token_to_id(names[f"{kind}_token"])
        if value is None and kind != "pad":
            value = tokenizer.token_to_id(ENDOFTEXT)
        ids[key] = None if value is None else int(value)
    return {"pad_token_id": ids["pad_token_id"], "bos_token_id": ids["bos_token_id"],
            "eos_token_id": ids["eos_token_id"]}


def read_hf_source(src: Path) -> HFSource:
    """Read and check everything an import needs; raise ImportRefused with one line."""
    from model.tokenizer import checkpoint_special_ids

    if not src.is_dir():
        raise ImportRefused(f"{src} is not a directory (expected a Hugging Face model "
                            "directory with config.json and model.safetensors)")
    if not (src / HF_CONFIG).is_file():
        raise ImportRefused(f"{src} has no {HF_CONFIG}")
    hf, multimodal = text_model_config(_read_json(src / HF_CONFIG), src / HF_CONFIG)
    config = gpt_config_from_hf(hf, src / HF_CONFIG)
    files = _weight_files(src)
    stored: dict[str, str] = {}  # the file's own names where they differ
    if multimodal:
        files, stored = _text_weights(files)
    prefix = _check_weights(files, config, src, stored)
    names = _special_token_names(src)
    tokenizer = _load_tokenizer(src, names, architecture(config.arch))
    if tokenizer.get_vocab_size() > config.vocab_size:
        raise ImportRefused(f"{src}: the tokenizer has {tokenizer.get_vocab_size()} tokens but "
                            f"the model's vocab_size is {config.vocab_size}")
    special = _special_ids(src, hf, tokenizer, names)
    try:
        checkpoint_special_ids(tokenizer, special)
    except ValueError as exc:
        raise ImportRefused(f"{src}: special token ids: {exc}") from exc
    return HFSource(config, hf, files, prefix, tokenizer.to_str(), special, stored)


def state_dict_from_hf(source: HFSource) -> dict[str, Any]:
    """transformers' tensors → model.gpt.GPT's names and (out, in) layouts, as float32."""
    import torch
    from safetensors import safe_open

    arch = architecture(source.config.arch)
    raw: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name, path in source.weight_files.items():
        if not name.endswith(arch.hf_ignored_suffixes):
            by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                raw[name.removeprefix(source.prefix)] = f.get_tensor(
                    source.stored_names.get(name, name)).to(torch.float32)
    out = arch.state_dict_from_hf(raw, source.config)
    return {k: v.contiguous() for k, v in out.items()}


def check_target(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ImportRefused(f"output path {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ImportRefused(f"output directory {out} is not empty (use --force to replace it)")


def import_hf_checkpoint(src: Path, out: Path, *, force: bool = False,
                         sampling: dict[str, float | int] | None = None) -> Path:
    """Convert the Hugging Face model directory ``src`` into our checkpoint at ``out``.

    Everything is read and checked before ``out`` is touched, and the checkpoint is built
    beside it and renamed into place, so a refused or failed import leaves nothing behind.
    """
    import torch

    from model.gpt import GPT

    src, out = Path(src), Path(out)
    check_target(out, force)
    source = read_hf_source(src)
    state = state_dict_from_hf(source)
    with torch.device("meta"):  # no random init of weights that are replaced at once
        model = GPT(source.config)
    model.load_state_dict(state, strict=True, assign=True)
    if source.config.tie_weights:
        model.lm_head.weight = model.tok_emb.weight  # assign=True untied them
    model.eval()
    meta = CheckpointMeta(
        model=source.config,
        tokenizer={"kind": "bpe", **source.special},
        training={"imported_from": {
            "format": "huggingface", "path": str(src.resolve()),
            "architecture": (source.hf_config.get("architectures")
                             or [source.hf_config.get("model_type")])[0],
            "name_or_path": source.hf_config.get("_name_or_path"),
            "transformers_version": source.hf_config.get("transformers_version"),
        }},
    )
    # Files `attnserve export` carries into the artifact (chat template, end tokens).
    carried = {name: (src / name).read_bytes() for name in CARRIED_FILES
               if (src / name).is_file()}
    if sampling:
        carried[HF_GENERATION_CONFIG] = with_sampling(carried.get(HF_GENERATION_CONFIG),
                                                      sampling)
    return save_checkpoint(out, model, meta, source.tokenizer_json, extra_files=carried)
