"""A checkpoint that never was a GGUF file, as one: metadata from its config, the tokenizer
from its tokenizer.json, tensors from its weights.

What llama.cpp's ``convert_hf_to_gguf.py`` writes for the same model, derived from our
config through the architecture's own transformers config (``Architecture.hf_config``, the
inverse of the import): the family (``general.architecture``), its hyper-parameter keys,
Llama 3's ``rope_freqs`` and Phi-3's LongRoPE factors as tensors, GPT-2's zero biases and
position table where ours has none. A model llama.cpp would compute differently is
refused with one line: a ReLU or exact-GELU GPT (llama.cpp's gpt2 runs the tanh GELU),
a window llama.cpp's llama graph does not apply, layers without rotary other than
SmolLM3's every fourth, a Gemma 3 query scale llama.cpp does not derive.

The tokenizer is byte-level BPE (``tokenizer.ggml.model`` gpt2): tokens by id (padded
vocabularies filled with unused ``[PADn]`` tokens, as the converter does), types (special
added tokens CONTROL, other added tokens USER_DEFINED), merges, special ids, whether bos
is added, the chat template, and ``pre``: the name llama.cpp knows the pre-tokenizer by,
recognised from the tokenizer's own split rules (model/gguf/vocab.py holds each
name's rules). A pre-tokenizer llama.cpp has no name for, or a SentencePiece or character
tokenizer, is refused: llama.cpp would tokenize it otherwise and degrade quietly
(llama.cpp#7476).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from export.gguf.layout import (
    FILE_TYPES,
    OUTTYPES,
    GGUFOutRefused,
    assemble,
    encode,
    kind_for,
    layouts,
)
from model.architectures import architecture
from model.architectures.llama import SMOLLM3_NOPE_STEP  # no rotary in every fourth layer
from model.checkpoint import TOKENIZER_FILE, CheckpointMeta
from model.gguf.vocab import CONTROL, GPT2_SPLIT, NORMAL, PRE_TOKENIZERS, USER_DEFINED
from service.contract.atomic_gguf import write_atomically

UNUSED = 5  # gguf.TokenType.UNUSED: the converter's padding tokens
# transformers' model_type → llama.cpp's general.architecture
FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
            "smollm3": "smollm3", "phi3": "phi3", "gemma3_text": "gemma3", "gpt2": "gpt2"}
DIGITS = r"\p{N}"


def model_type(config: Any) -> str:
    """transformers' ``model_type`` of the model (gpt2 for our own GPT)."""
    if config.arch == "gpt":
        return "gpt2"
    return str(architecture(config.arch).hf_config(config, {})["model_type"])


def family_of(config: Any) -> str:
    """llama.cpp's architecture for the model, or GGUFOutRefused naming what it lacks."""
    kind = model_type(config)
    if config.arch == "gpt":
        if config.activation != "gelu_tanh":
            raise GGUFOutRefused(f"llama.cpp's gpt2 computes the tanh GELU; this GPT's "
                                 f"{config.activation} has no llama.cpp architecture")
        return "gpt2"
    if kind not in FAMILIES:
        raise GGUFOutRefused(f"no llama.cpp architecture for transformers' {kind}")
    window = config.sliding_window
    if window is not None and window < config.max_seq_len and kind in ("mistral", "phi3"):
        raise GGUFOutRefused(f"llama.cpp's {FAMILIES[kind]} graph attends to the whole "
                             f"past; this model's window of {window} positions would be lost")
    if kind == "smollm3":
        every_fourth = tuple(i for i in range(config.n_layers)
                             if (i + 1) % SMOLLM3_NOPE_STEP == 0)
        if tuple(config.nope_layers) != every_fourth:
            raise GGUFOutRefused(f"llama.cpp's smollm3 leaves rotary out of every fourth "
                                 f"layer {list(every_fourth)}, this model of layers "
                                 f"{list(config.nope_layers)}")
    if kind == "gemma3_text":
        wanted = config.head_dim ** -0.5
        if config.attn_scale is not None and not math.isclose(config.attn_scale, wanted,
                                                              rel_tol=1e-6):
            raise GGUFOutRefused(f"llama.cpp's gemma3 scales queries by 1/√head_dim "
                                 f"({wanted:.6g}); this model by {config.attn_scale:.6g}")
    return FAMILIES[kind]


def hyper_parameters(writer: gguf.GGUFWriter, family: str, config: Any,
                     hf: dict[str, Any]) -> None:
    """The ``{family}.*`` keys llama.cpp reads for this model (as its converter writes)."""
    writer.add_block_count(config.n_layers)
    writer.add_context_length(config.max_seq_len)
    writer.add_embedding_length(config.d_model)
    writer.add_feed_forward_length(config.d_ff)
    writer.add_head_count(config.n_heads)
    if family == "gpt2":
        writer.add_layer_norm_eps(config.layer_norm_eps)
        return
    writer.add_head_count_kv(config.kv_heads)
    writer.add_layer_norm_rms_eps(config.layer_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    if family in ("llama", "smollm3"):
        writer.add_rope_dimension_count(config.head_dim)
        writer.add_vocab_size(config.vocab_size)
    if family == "phi3":
        writer.add_rope_dimension_count(config.rotary_dims)
        writer.add_rope_scaling_orig_ctx_len(int(hf.get("original_max_position_embeddings")
                                                 or config.max_seq_len))
    if family in ("qwen3", "gemma3") or config.head_dim != config.d_model // config.n_heads:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
    elif kind == "longrope":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
        writer.add_rope_scaling_attn_factors(float(scaling["attention_factor"]))
    if family == "gemma3":
        if config.sliding_window is not None:
            writer.add_sliding_window(config.sliding_window)
            writer.add_sliding_window_pattern([config.windowed(i)
                                               for i in range(config.n_layers)])
        if config.local_rope_theta is not None:
            writer.add_rope_freq_base_swa(config.local_rope_theta)


def extra_tensors(family: str, config: Any) -> dict[str, np.ndarray]:
    """Tensors of the config (Llama 3's rope_freqs, Phi-3's LongRoPE factors)."""
    from model.rotary import inverse_frequencies

    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":  # llama.cpp divides each frequency by its factor
        base = inverse_frequencies(config.rotary_dims, config.rope_theta)
        scaled = inverse_frequencies(config.rotary_dims, config.rope_theta, scaling)
        return {"rope_freqs.weight": (base / scaled).numpy().astype(np.float32)}
    if kind == "longrope" and family == "phi3":
        return {"rope_factors_long.weight": np.asarray(scaling["long_factor"], np.float32),
                "rope_factors_short.weight": np.asarray(scaling["short_factor"], np.float32)}
    if kind not in (None, "default", "linear"):
        raise GGUFOutRefused(f"rope_scaling {kind!r} is not written for llama.cpp's {family}")
    return {}


def planned_shapes(arch: Any, family: str, config: Any,
                   state: dict[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    """llama.cpp's tensors our parameters make, in the converter's order (embeddings,
    blocks, final norm, head), with their shapes: the inverse of the import's tables."""
    shapes: dict[str, tuple[int, ...]] = {}

    def plan(name: str, params: list[str]) -> None:
        if params and all(p in state for p in params):
            rows = sum(state[p].shape[0] for p in params)
            shapes[name] = (rows, *state[params[0]].shape[1:])

    globals_ = dict(arch.gguf_globals)
    for gguf_name in ("token_embd", "position_embd"):
        if gguf_name in globals_:
            for suffix in ("weight", "bias"):
                plan(f"{gguf_name}.{suffix}", [f"{globals_[gguf_name]}.{suffix}"])
    for i in range(config.n_layers):
        for part, ours in arch.gguf_layer_map(family).items():
            for suffix in ("weight", "bias"):
                plan(f"blk.{i}.{part}.{suffix}", [f"blocks.{i}.{o}.{suffix}" for o in ours])
    for gguf_name in ("output_norm", "output"):
        for suffix in ("weight", "bias"):
            if not (gguf_name == "output" and config.tie_weights):
                plan(f"{gguf_name}.{suffix}", [f"{globals_[gguf_name]}.{suffix}"])
    return shapes


def gpt2_state(model: Any, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What llama.cpp's gpt2 requires and a GPT of ours may lack: zero attention biases and
    the position table (a sinusoidal one written out, which reproduces it exactly)."""
    out = dict(state)
    config = model.config
    for i in range(config.n_layers):
        for name, width in (("w_q", config.d_model), ("w_k", config.kv_heads * config.head_dim),
                            ("w_v", config.kv_heads * config.head_dim), ("w_o", config.d_model)):
            out.setdefault(f"blocks.{i}.attn.{name}.bias", np.zeros(width, np.float32))
    if "pos_emb.weight" not in out:
        out["pos_emb.weight"] = model.pos_table.detach().float().numpy()
    return out


def _pre_name(tok: dict[str, Any], where: Path) -> str:
    """llama.cpp's name for tokenizer.json's pre-tokenizer (its split rules in order)."""
    def rules(node: dict[str, Any] | None) -> list[str]:
        if node is None:
            return []
        kind = node.get("type")
        if kind == "Sequence":
            return [r for child in node.get("pretokenizers", []) for r in rules(child)]
        if kind == "ByteLevel":
            return [GPT2_SPLIT] if node.get("use_regex", True) else []
        if kind == "Digits" and node.get("individual_digits"):
            return [DIGITS]
        if kind == "Split" and node.get("behavior") == "Isolated":
            pattern = node.get("pattern", {})
            return [str(pattern.get("Regex", pattern.get("String")))]
        raise GGUFOutRefused(f"{where}: its {kind} pre-tokenizer has no llama.cpp "
                             "equivalent")

    splits = tuple(rules(tok.get("pre_tokenizer")))
    normalizer = (tok.get("normalizer") or {}).get("type")
    for name, pre in PRE_TOKENIZERS.items():
        if pre.splits == splits and pre.nfc == (normalizer == "NFC"):
            return name
    raise GGUFOutRefused(f"{where}: no tokenizer.ggml.pre llama.cpp knows splits text as this "
                         f"tokenizer does ({len(splits)} split rules); llama.cpp would "
                         "tokenize it differently")


def tokenizer_keys(writer: gguf.GGUFWriter, ckpt_dir: Path, meta: CheckpointMeta,
                   vocab_size: int) -> None:
    """``tokenizer.ggml.*`` and the chat template from the checkpoint's tokenizer.json."""
    from model.finetune.supervision import checkpoint_template, stop_ids_of

    path = ckpt_dir / TOKENIZER_FILE
    tok = json.loads(path.read_text("utf-8"))
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        kind = "SentencePiece" if model.get("byte_fallback") else str(model.get("type"))
        raise GGUFOutRefused(f"{path}: a {kind} tokenizer is not written, only byte-level "
                             "BPE (a model imported from a GGUF file keeps that file's "
                             "vocabulary, whatever it is)")
    pre = _pre_name(tok, path)
    ids: dict[str, int] = dict(model["vocab"])
    added = {t["content"]: t for t in tok.get("added_tokens", [])}
    ids.update({content: int(t["id"]) for content, t in added.items()})
    size = max(vocab_size, max(ids.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [UNUSED] * size
    for text, i in ids.items():
        tokens[i] = text
        types[i] = (CONTROL if added[text]["special"] else USER_DEFINED) if text in added \
            else NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    special = meta.tokenizer
    for key, add in (("bos_token_id", writer.add_bos_token_id),
                     ("eos_token_id", writer.add_eos_token_id),
                     ("pad_token_id", writer.add_pad_token_id)):
        if isinstance(special.get(key), int):
            add(int(special[key]))
    eos = special.get("eos_token_id")
    others = sorted(stop_ids_of(ckpt_dir, eos if isinstance(eos, int) else None) - {eos})
    if others:  # an end-of-turn token besides eos (Qwen's <|im_end|> beside <|endoftext|>)
        writer.add_eot_token_id(others[0])
    writer.add_add_bos_token(_adds_bos(tok, special.get("bos_token_id"), tokens))
    writer.add_add_eos_token(False)
    from tokenizers import Tokenizer

    template = checkpoint_template(ckpt_dir, Tokenizer.from_file(str(path)), special)
    if template.origin != "default":
        writer.add_chat_template(template.source)


def _adds_bos(tok: dict[str, Any], bos: Any, tokens: list[str]) -> bool:
    """Whether tokenizer.json's post-processor puts bos before a text (Llama 3's does)."""
    post = tok.get("post_processor") or {}
    nodes = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    for node in nodes:
        if node.get("type") == "TemplateProcessing" and isinstance(bos, int):
            first = (node.get("single") or [{}])[0]
            return first.get("SpecialToken", {}).get("id") == tokens[bos]
    return False


def export_generated(ckpt_dir: Path, meta: CheckpointMeta, out: Path, outtype: str | None,
                     say: Any) -> Path:
    """Write a checkpoint that never was GGUF (see the module docstring)."""
    from model.checkpoint import load_checkpoint

    config = meta.model
    arch = architecture(config.arch)
    special = {k: meta.tokenizer.get(k) for k in ("pad_token_id", "bos_token_id",
                                                   "eos_token_id")}
    hf = arch.hf_config(config, special) if config.arch != "gpt" else {"model_type": "gpt2"}
    family = family_of(config)
    model = load_checkpoint(ckpt_dir).model
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if family == "gpt2":
        state = gpt2_state(model, state)
    shapes = planned_shapes(arch, family, config, state)
    sources = arch.gguf_sources(family, config, {n: s[0] for n, s in shapes.items()})
    planned = layouts(sources, shapes, config.tie_weights)
    kind = OUTTYPES[outtype or "f32"]
    say(f"writing {len(planned)} tensors as llama.cpp's {family} ({kind.name})")

    def write(path: Path) -> gguf.GGUFWriter:
        writer = gguf.GGUFWriter(str(path), family)
        writer.add_name(out.stem)
        writer.add_description("written by attnserve export --format gguf")
        hyper_parameters(writer, family, config, hf)
        tokenizer_keys(writer, ckpt_dir, meta, config.vocab_size)
        quantised = False
        for name, data in extra_tensors(family, config).items():
            writer.add_tensor(name, data)
        names = {layout.name for layout in planned}
        for layout in planned:
            encoded, used = encode(assemble(layout, state), kind_for(layout.name, kind, names))
            quantised |= used not in (gguf.GGMLQuantizationType.F32,
                                      gguf.GGMLQuantizationType.F16)
            writer.add_tensor(layout.name, encoded,
                              raw_dtype=None if used in (gguf.GGMLQuantizationType.F32,
                                                         gguf.GGMLQuantizationType.F16)
                              else used)
        writer.add_file_type(int(FILE_TYPES[kind]))
        if quantised:
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        return writer

    return write_atomically(write, out)
