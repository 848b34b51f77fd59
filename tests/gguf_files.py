"""GGUF files written the way llama.cpp's convert_hf_to_gguf.py writes them, for the tests.

Nothing is downloaded: the source is a transformers model directory built locally
(tests/hf_llama.py, tests/hf_gpt2.py). Tensor names come from gguf's own name map; Llama's
``q_proj``/``k_proj`` rows are permuted as llama.cpp's ``LlamaModel.permute`` does (Qwen2's
are not), GPT-2's Conv1D weights are transposed to (out, in), 1-D tensors stay F32 and
matrices take the requested types in turn. Types gguf-py can quantise are quantised from
the model's weights; for the K-quants, which it only dequantises, the blocks are random
bytes with their fp16 scales rescaled to a sane weight spread (and, for those with
minimums, sub-blocks centred on zero as real weights' are): dequantisation is what is
tested, and transformers reads the same bytes. The tokenizer goes in as llama.cpp stores
a byte-level BPE: tokens, types (special added tokens CONTROL, other added tokens
USER_DEFINED), merges, special ids, ``pre`` and the chat template.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
K_QUANTS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# Byte offsets of the fp16 super-block scales (d, dmin) in each K-quant block.
K_SCALE_OFFSETS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2),
                   Q.Q6_K: (208,)}
# The largest code of the K-quants with minimums.
K_TOPS = {Q.Q2_K: 3, Q.Q4_K: 15, Q.Q5_K: 31}


@dataclass
class TokenizerSpec:
    """What goes into the ``tokenizer.*`` keys besides the vocabulary."""

    pre: str = "gpt-2"
    model: str = "gpt2"
    bos: str | None = None
    eos: str | None = None
    pad: str | None = None
    eot: str | None = None
    add_bos: bool | None = None
    chat_template: str | None = None
    user_defined: Sequence[str] = field(default_factory=tuple)  # added, not special


def llamacpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: halves layout → interleaved pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def pack_k_scales(sc: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's eight 6-bit sub-block scales and minimums (..., 8) → their 12 bytes:
    bytes 0-3 hold scales 0-3 and the top 2 bits of scales 4-7, bytes 4-7 minimums 0-3 and
    the top bits of minimums 4-7, bytes 8-11 the low nibbles of scales and minimums 4-7."""
    out = np.empty((*sc.shape[:-1], 12), np.uint8)
    out[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    out[..., 4:8] = mins[..., :4] | ((mins[..., 4:] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:] & 0x0F) | ((mins[..., 4:] & 0x0F) << 4)
    return out


def _centre_minimums(raw: np.ndarray, qtype: Q, rng: np.random.Generator) -> None:
    """Sub-block scales sc in the upper half of their range and minimums m ≈ sc (beside
    dmin = d·top/2, set by the caller), so each sub-block's values d·sc·q − dmin·m centre on
    zero, as llama.cpp's quantiser makes them of zero-mean weights. (Random minimums shift
    whole blocks; on such weights int8 activations cost the logits 3-6%.) raw (N, nb, bytes)"""
    subs, bits = (16, 4) if qtype == Q.Q2_K else (8, 6)
    sc = rng.integers(1 << (bits - 1), 1 << bits, (*raw.shape[:2], subs), dtype=np.uint8)
    mins = np.clip(sc.astype(np.int64) + rng.integers(-2, 3, sc.shape), 0, (1 << bits) - 1)
    if qtype == Q.Q2_K:
        raw[..., :16] = sc | (mins.astype(np.uint8) << 4)
    else:
        raw[..., 4:16] = pack_k_scales(sc, mins.astype(np.uint8))


def random_k_blocks(shape: tuple[int, int], qtype: Q, rng: np.random.Generator,
                    std: float = 0.05, centred: bool = True) -> np.ndarray:
    """Valid ``qtype`` blocks for a (rows, cols) matrix whose weights have about ``std``;
    ``centred``: the blocks with minimums (Q2_K, Q4_K, Q5_K) centred on zero, else every
    byte but the super-block scales random."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)

    def set_scales(values: np.ndarray) -> None:
        for i, off in enumerate(K_SCALE_OFFSETS[qtype]):
            raw[..., off:off + 2] = values[..., i:i + 1].astype(np.float16).view(np.uint8)

    scales = rng.uniform(0.5, 1.0, (rows, cols // block, len(K_SCALE_OFFSETS[qtype])))
    if centred and qtype in K_TOPS:
        _centre_minimums(raw, qtype, rng)
        scales[..., 1] = scales[..., 0] * K_TOPS[qtype] / 2  # dmin = d·top/2
    set_scales(scales)
    spread = float(gguf.quants.dequantize(raw.reshape(rows, -1), qtype).std())
    set_scales(scales * std / spread)
    return raw.reshape(rows, -1)


def encode_tensor(data: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """The bytes (or floats) GGUFWriter.add_tensor takes for ``qtype``."""
    if qtype == Q.F32:
        return np.ascontiguousarray(data, dtype=np.float32)
    if qtype in K_QUANTS:
        return random_k_blocks((data.shape[0], data.shape[1]), qtype, rng)
    return gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), qtype)


def _add_tokenizer(writer: gguf.GGUFWriter, tokenizer_json: Path, spec: TokenizerSpec) -> None:
    data = json.loads(tokenizer_json.read_text("utf-8"))
    vocab: dict[str, int] = dict(data["model"]["vocab"])
    added = {t["content"]: t for t in data["added_tokens"]}
    for content, token in added.items():
        vocab[content] = token["id"]
    tokens = [""] * (max(vocab.values()) + 1)
    for token_text, i in vocab.items():
        tokens[i] = token_text
    types = [gguf.TokenType.USER_DEFINED if t in spec.user_defined else
             gguf.TokenType.CONTROL if t in added and added[t]["special"] else
             gguf.TokenType.USER_DEFINED if t in added else gguf.TokenType.NORMAL
             for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model(spec.model)
    writer.add_tokenizer_pre(spec.pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if spec.model == "llama":  # SentencePiece files carry scores, not merges
        writer.add_token_scores([0.0] * len(tokens))
    else:
        writer.add_token_merges(merges)
    for name, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                      ("pad", writer.add_pad_token_id), ("eot", writer.add_eot_token_id)):
        token = getattr(spec, name)
        if token is not None:
            add(vocab[token])
    if spec.add_bos is not None:
        writer.add_add_bos_token(spec.add_bos)
    if spec.chat_template is not None:
        writer.add_chat_template(spec.chat_template)


def _llama3_rope_factors(hp: dict[str, Any]) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for rope_type llama3."""
    scaling = hp["rope_scaling"]
    dim = hp["hidden_size"] // hp["num_attention_heads"]
    freqs = 1.0 / (hp["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = hp.get("original_max_position_embeddings", 8192)  # top level, as the converter reads
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


# transformers' model_type → general.architecture
GGUF_ARCH = {"mistral": "llama", "gemma3_text": "gemma3"}


def _llama_metadata(writer: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    heads = hp["num_attention_heads"]
    writer.add_block_count(hp["num_hidden_layers"])
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(hp.get("num_key_value_heads") or heads)
    writer.add_rope_freq_base(hp["rope_theta"])
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if hp["model_type"] in ("llama", "smollm3", "mistral", "phi3"):  # Phi3MiniModel: partial
        rotary = float(hp.get("partial_rotary_factor", 1.0))
        writer.add_rope_dimension_count(int(rotary * hp["hidden_size"]) // heads)
    if hp["model_type"] == "phi3":  # Phi3MiniModel.set_gguf_parameters
        writer.add_rope_scaling_orig_ctx_len(hp["original_max_position_embeddings"])
        if (hp.get("rope_scaling") or {}).get("long_factor"):  # its LongRoPE attn factor
            scale = hp["max_position_embeddings"] / hp["original_max_position_embeddings"]
            writer.add_rope_scaling_attn_factors(math.sqrt(
                1 + math.log(scale) / math.log(hp["original_max_position_embeddings"])))
    if hp.get("sliding_window") is not None:
        writer.add_sliding_window(hp["sliding_window"])
    if hp["model_type"] == "gemma3_text":  # TextModel's rope_theta of the window layers
        writer.add_rope_freq_base_swa(hp["rope_local_base_freq"])
    if hp.get("head_dim") is not None:  # convert_hf_to_gguf.py's TextModel writes both
        writer.add_key_length(hp["head_dim"])
        writer.add_value_length(hp["head_dim"])
    scaling = hp.get("rope_scaling") or {}
    if scaling.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])


def _gpt2_metadata(writer: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    writer.add_block_count(hp["n_layer"])
    writer.add_context_length(hp["n_positions"])
    writer.add_embedding_length(hp["n_embd"])
    writer.add_feed_forward_length(hp.get("n_inner") or 4 * hp["n_embd"])
    writer.add_head_count(hp["n_head"])
    writer.add_layer_norm_eps(hp["layer_norm_epsilon"])


def _gguf_tensors(hf_dir: Path, hp: dict[str, Any]) -> dict[str, np.ndarray]:
    """The model's weights under GGUF names and layouts (float32), in file order."""
    from safetensors.numpy import load_file

    arch = hp["model_type"]
    n_layers = hp["n_layer"] if arch == "gpt2" else hp["num_hidden_layers"]
    names = gguf.get_tensor_name_map(
        {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
         "qwen3": gguf.MODEL_ARCH.QWEN3, "smollm3": gguf.MODEL_ARCH.SMOLLM3,
         "mistral": gguf.MODEL_ARCH.LLAMA, "phi3": gguf.MODEL_ARCH.PHI3,
         "gemma3_text": gguf.MODEL_ARCH.GEMMA3, "gpt2": gguf.MODEL_ARCH.GPT2}[arch], n_layers)
    out: dict[str, np.ndarray] = {}
    for name, data in load_file(str(hf_dir / "model.safetensors")).items():
        if name.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")):
            continue
        if name == "lm_head.weight" and hp.get("tie_word_embeddings", True):
            continue
        if arch == "gpt2" and name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            data = data.T  # Conv1D (in, out) → (out, in)
        if arch in ("llama", "smollm3", "mistral") and ".q_proj." in name:  # LlamaModel's
            data = llamacpp_permute(data, hp["num_attention_heads"])
        if arch in ("llama", "smollm3", "mistral") and ".k_proj." in name:
            data = llamacpp_permute(data, hp["num_attention_heads"], hp["num_key_value_heads"])
        if arch == "gemma3_text" and name.endswith("norm.weight"):  # Gemma3Model.norm_shift
            data = data + np.float32(1.0)
        new = names.get_name(name.removeprefix("transformer."), try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ValueError(f"no GGUF name for {name}")
        out[new] = np.ascontiguousarray(data, dtype=np.float32)
    if arch == "llama" and (hp.get("rope_scaling") or {}).get("rope_type") == "llama3":
        out["rope_freqs.weight"] = _llama3_rope_factors(hp)
    scaling = hp.get("rope_scaling") or {}
    if arch == "phi3" and scaling.get("long_factor"):  # Phi3MiniModel.generate_extra_tensors
        out["rope_factors_long.weight"] = np.asarray(scaling["long_factor"], np.float32)
        out["rope_factors_short.weight"] = np.asarray(scaling["short_factor"], np.float32)
    return out


def _metadata_type(value: Any) -> tuple[gguf.GGUFValueType, gguf.GGUFValueType | None]:
    kinds = {bool: gguf.GGUFValueType.BOOL, int: gguf.GGUFValueType.UINT32,
             float: gguf.GGUFValueType.FLOAT32, str: gguf.GGUFValueType.STRING}
    if isinstance(value, list):
        return gguf.GGUFValueType.ARRAY, kinds[type(value[0])] if value else kinds[str]
    return kinds[type(value)], None


def write_gguf(hf_dir: Path, out: Path, types: Sequence[Q] = (Q.F32,),
               tokenizer: TokenizerSpec | None = None, seed: int = 0,
               architecture: str | None = None, drop: Sequence[str] = (),
               metadata: dict[str, Any] | None = None) -> Path:
    """Write ``hf_dir`` (config.json, model.safetensors, tokenizer.json) as a GGUF file.

    Matrices take ``types`` in turn (1-D tensors stay F32). For refusal tests,
    ``architecture`` overrides general.architecture, ``drop`` leaves tensors out and
    ``metadata`` adds or overwrites keys (types inferred: str, bool, int as uint32, float
    as float32, lists of them).
    """
    hp = json.loads((hf_dir / "config.json").read_text("utf-8"))
    arch = hp["model_type"]
    # llama.cpp's converter writes Mistral as llama (and its window, where it has one)
    writer = gguf.GGUFWriter(str(out), architecture or GGUF_ARCH.get(arch, arch))
    writer.add_name(f"attnserve-test-{arch}")
    (_gpt2_metadata if arch == "gpt2" else _llama_metadata)(writer, hp)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if tuple(types) == (Q.F32,)
                         else gguf.LlamaFileType.GUESSED)
    _add_tokenizer(writer, hf_dir / "tokenizer.json", tokenizer or TokenizerSpec())
    for key, value in (metadata or {}).items():
        writer.kv_data[0].pop(key, None)  # overwrite without the duplicate-key warning
        writer.add_key_value(key, value, *_metadata_type(value))
    rng = np.random.default_rng(seed)
    matrices = 0
    for name, data in _gguf_tensors(hf_dir, hp).items():
        if name in drop:
            continue
        qtype = Q.F32
        if data.ndim == 2:
            qtype, matrices = types[matrices % len(types)], matrices + 1
        encoded = encode_tensor(data, qtype, rng)
        writer.add_tensor(name, encoded, raw_dtype=None if qtype == Q.F32 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def set_tensor_type_id(path: Path, tensor: str, type_id: int) -> None:
    """Overwrite one tensor's GGML type id in the header (an unknown-type refusal test)."""
    data = bytearray(path.read_bytes())
    name = tensor.encode()
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    at += 4 + 8 * n_dims
    data[at:at + 4] = type_id.to_bytes(4, "little")
    path.write_bytes(bytes(data))
