"""Import a local Hugging Face GPT-2 or Llama-family directory as an attnserve checkpoint.

Usage (through the CLI):
    attnserve import --hf models/distilgpt2 --out checkpoints/distilgpt2
    attnserve import --hf models/SmolLM2-135M-Instruct --out checkpoints/smollm2

Reads ``config.json`` (model_type gpt2, GPT2LMHeadModel; or llama / qwen2, whose
conversion lives in model/hf_llama.py), ``model.safetensors`` (or the
shards a ``model.safetensors.index.json`` lists), the tokenizer as ``tokenizer.json`` or
``vocab.json`` + ``merges.txt``, and ``generation_config.json`` when present, and writes
our checkpoint directory (config.json, model.safetensors, tokenizer.json) atomically,
with the chat template (``chat_template.jinja``), ``tokenizer_config.json`` and
``generation_config.json`` copied beside them for the chat route.

Everything is checked before anything is written, so a refused import leaves nothing
behind: pickled weights (``pytorch_model.bin``) are never opened, and configuration
options our model does not compute (layer-scaled attention, cross-attention, pruned
heads, other activations ...) are refused rather than converted into a different
network. GPT-2 stores its linear layers as ``Conv1D`` with (in, out) weights and fuses
Q, K and V into one ``c_attn``; the conversion transposes and splits them, which is
exact, so ``attnserve export --format hf`` gives back bit-identical tensors.

transformers is not needed; nothing is downloaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model.checkpoint import CheckpointMeta, save_checkpoint
from model.config import ActivationKind, GPTConfig
from model.hf_llama import ARCHITECTURES as LLAMA_ARCHITECTURES
from model.hf_llama import IGNORED_SUFFIXES as LLAMA_IGNORED
from model.hf_llama import llama_config_from_hf, llama_expected_shapes, llama_state_dict

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

# transformers' ACT2FN names → ours. gelu_new and gelu_pytorch_tanh are the same tanh
# approximation; "gelu" is the exact erf form.
ACTIVATIONS: dict[str, ActivationKind] = {
    "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu",
}
# Buffers older transformers versions saved with the weights (the causal mask); not weights.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", *LLAMA_IGNORED)

SAFETENSORS_HINT = (
    "convert it once with transformers: GPT2LMHeadModel.from_pretrained(DIR)"
    ".save_pretrained(DIR, safe_serialization=True), or download the model's "
    "model.safetensors (e.g. `hf download gpt2 model.safetensors --local-dir DIR`)")


class ImportRefused(ValueError):
    """The directory is not something this importer converts faithfully (one-line reason)."""


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
    hf_config: dict[str, Any]
    weight_files: dict[str, Path]  # HF tensor name → safetensors file holding it
    prefix: str  # "transformer." or "" (checkpoints saved from GPT2Model)
    tokenizer_json: str
    special: dict[str, int | None]


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


def gpt_config_from_hf(hf: dict[str, Any], where: Path) -> GPTConfig:
    """GPTConfig computing exactly what GPT2LMHeadModel computes for ``hf``, or a refusal."""

    def refuse(reason: str) -> ImportRefused:
        return ImportRefused(f"{where}: {reason}")

    model_type = hf.get("model_type")
    if model_type in LLAMA_ARCHITECTURES:
        return llama_config_from_hf(hf, refuse)
    if model_type != "gpt2":
        raise refuse(f"model_type {model_type!r} is not supported; attnserve imports the "
                     "GPT-2 (model_type 'gpt2') and Llama (llama, qwen2) architectures")
    architectures = hf.get("architectures") or ["GPT2LMHeadModel"]
    if architectures != ["GPT2LMHeadModel"]:
        raise refuse(f"architectures {architectures} are not supported; only "
                     "GPT2LMHeadModel (a causal language model) is")
    # Options that change what the network computes and that our model does not have.
    # (reorder_and_upcast_attn is refused too: its scale-then-upcast path is not ours.)
    for key, harmless in (("scale_attn_by_inverse_layer_idx", False),
                          ("reorder_and_upcast_attn", False), ("add_cross_attention", False),
                          ("scale_attn_weights", True)):
        if hf.get(key, harmless) != harmless:
            raise refuse(f"{key}={hf[key]!r} is not supported (only {harmless})")
    if hf.get("pruned_heads"):
        raise refuse("pruned_heads are not supported (every layer must keep all its heads)")
    if hf.get("quantization_config"):
        raise refuse("quantized checkpoints (quantization_config) are not supported; "
                     "import the float weights")
    act = hf.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise refuse(f"activation_function {act!r} is not supported; one of "
                     f"{sorted(ACTIVATIONS)}")
    try:
        d_model = int(hf.get("n_embd", 768))
        n_inner = hf.get("n_inner")
        return GPTConfig(
            vocab_size=int(hf.get("vocab_size", 50257)),
            d_model=d_model,
            n_heads=int(hf.get("n_head", 12)),
            n_layers=int(hf.get("n_layer", 12)),
            d_ff=int(n_inner) if n_inner is not None else 4 * d_model,
            max_seq_len=int(hf.get("n_positions", 1024)),
            position="learned",
            activation=ACTIVATIONS[act],
            tie_weights=bool(hf.get("tie_word_embeddings", True)),
            layer_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
            attn_bias=True,
        )
    except (TypeError, ValueError) as exc:
        raise refuse(f"unsupported dimensions: {exc}") from exc


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


def expected_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """GPT2LMHeadModel's tensors (without the ``transformer.`` prefix) and their shapes."""
    d, f, v = config.d_model, config.d_ff, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (v, d),
                                          "wpe.weight": (config.max_seq_len, d)}
    for i in range(config.n_layers):
        p = f"h.{i}"
        shapes.update({
            f"{p}.ln_1.weight": (d,), f"{p}.ln_1.bias": (d,),
            f"{p}.attn.c_attn.weight": (d, 3 * d), f"{p}.attn.c_attn.bias": (3 * d,),
            f"{p}.attn.c_proj.weight": (d, d), f"{p}.attn.c_proj.bias": (d,),
            f"{p}.ln_2.weight": (d,), f"{p}.ln_2.bias": (d,),
            f"{p}.mlp.c_fc.weight": (d, f), f"{p}.mlp.c_fc.bias": (f,),
            f"{p}.mlp.c_proj.weight": (f, d), f"{p}.mlp.c_proj.bias": (d,),
        })
    shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,)})
    return shapes


def _check_weights(files: dict[str, Path], config: GPTConfig, where: Path) -> str:
    """Check names and shapes against the config (headers only); return the name prefix."""
    from safetensors import safe_open

    names = [n for n in files if not n.endswith(IGNORED_SUFFIXES)]
    if config.arch == "llama":
        prefix, expected = "", llama_expected_shapes(config)
    else:
        prefix = "transformer." if any(n.startswith("transformer.") for n in names) else ""
        expected = {prefix + k: s for k, s in expected_shapes(config).items()}
    head = "lm_head.weight"
    if not config.tie_weights:
        expected[head] = (config.vocab_size, config.d_model)
    present = set(names)
    missing = sorted(set(expected) - present)
    extra = sorted(present - set(expected) - {head})
    if missing or extra:
        raise ImportRefused(
            f"{where}: weights do not match a "
            f"{'causal Llama model' if config.arch == 'llama' else 'GPT2LMHeadModel'} of "
            "this config.json: "
            f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}, unexpected "
            f"{extra[:4]}{' ...' if len(extra) > 4 else ''}")
    by_file: dict[Path, list[str]] = {}
    for name in [*expected, *([head] if head in present else [])]:
        by_file.setdefault(files[name], []).append(name)
    for path, tensor_names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for name in tensor_names:
                sl = f.get_slice(name)
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


def _load_tokenizer(src: Path, names: dict[str, str], arch: str = "gpt") -> Any:
    from tokenizers import Tokenizer

    if arch == "llama" and not (src / HF_TOKENIZER).is_file():
        # Their vocab.json/merges.txt or tokenizer.model need the model's own pre-tokenizer
        # and normaliser, which only tokenizer.json spells out.
        raise ImportRefused(f"{src} has no {HF_TOKENIZER}; Llama-family models are imported "
                            "with their tokenizer.json (the fast tokenizer)")
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
    hf = _read_json(src / HF_CONFIG)
    config = gpt_config_from_hf(hf, src / HF_CONFIG)
    files = _weight_files(src)
    prefix = _check_weights(files, config, src)
    names = _special_token_names(src)
    tokenizer = _load_tokenizer(src, names, config.arch)
    if tokenizer.get_vocab_size() > config.vocab_size:
        raise ImportRefused(f"{src}: the tokenizer has {tokenizer.get_vocab_size()} tokens but "
                            f"the model's vocab_size is {config.vocab_size}")
    special = _special_ids(src, hf, tokenizer, names)
    try:
        checkpoint_special_ids(tokenizer, special)
    except ValueError as exc:
        raise ImportRefused(f"{src}: special token ids: {exc}") from exc
    return HFSource(config, hf, files, prefix, tokenizer.to_str(), special)


def state_dict_from_hf(source: HFSource) -> dict[str, Any]:
    """GPT-2's tensors → model.gpt.GPT's names and (out, in) layouts, as float32."""
    import torch
    from safetensors import safe_open

    raw: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name, path in source.weight_files.items():
        if not name.endswith(IGNORED_SUFFIXES):
            by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                raw[name.removeprefix(source.prefix)] = f.get_tensor(name).to(torch.float32)
    cfg, d = source.config, source.config.d_model
    if cfg.arch == "llama":
        return {k: v.contiguous() for k, v in llama_state_dict(raw, cfg).items()}
    out: dict[str, torch.Tensor] = {"tok_emb.weight": raw["wte.weight"],  # (V, d)
                                    "pos_emb.weight": raw["wpe.weight"]}  # (L, d)
    for i in range(cfg.n_layers):
        h, b = f"h.{i}", f"blocks.{i}"
        w_qkv = raw[f"{h}.attn.c_attn.weight"].t()  # (3d, d): Conv1D stores (in, out)
        b_qkv = raw[f"{h}.attn.c_attn.bias"]  # (3d,)
        for j, name in enumerate(("w_q", "w_k", "w_v")):
            # clone: each projection gets its own storage, not a view into c_attn
            out[f"{b}.attn.{name}.weight"] = w_qkv[j * d:(j + 1) * d].clone()  # (d, d)
            out[f"{b}.attn.{name}.bias"] = b_qkv[j * d:(j + 1) * d].clone()  # (d,)
        out[f"{b}.attn.w_o.weight"] = raw[f"{h}.attn.c_proj.weight"].t()  # (d, d)
        out[f"{b}.attn.w_o.bias"] = raw[f"{h}.attn.c_proj.bias"]
        out[f"{b}.ffn.up.weight"] = raw[f"{h}.mlp.c_fc.weight"].t()  # (d_ff, d)
        out[f"{b}.ffn.up.bias"] = raw[f"{h}.mlp.c_fc.bias"]
        out[f"{b}.ffn.down.weight"] = raw[f"{h}.mlp.c_proj.weight"].t()  # (d, d_ff)
        out[f"{b}.ffn.down.bias"] = raw[f"{h}.mlp.c_proj.bias"]
        for ln in ("ln_1", "ln_2"):
            out[f"{b}.{ln}.weight"] = raw[f"{h}.{ln}.weight"]
            out[f"{b}.{ln}.bias"] = raw[f"{h}.{ln}.bias"]
    out["ln_f.weight"], out["ln_f.bias"] = raw["ln_f.weight"], raw["ln_f.bias"]
    # Tied: GPT2LMHeadModel ties the head to wte whatever lm_head.weight a file holds.
    out["lm_head.weight"] = raw["wte.weight"] if cfg.tie_weights else raw["lm_head.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def check_target(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ImportRefused(f"output path {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ImportRefused(f"output directory {out} is not empty (use --force to replace it)")


def import_hf_checkpoint(src: Path, out: Path, *, force: bool = False,
                         sampling: dict[str, float | int] | None = None) -> Path:
    """Convert the Hugging Face GPT-2 directory ``src`` into our checkpoint at ``out``.

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
            "architecture": (source.hf_config.get("architectures") or ["GPT2LMHeadModel"])[0],
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
