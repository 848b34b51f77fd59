"""`attnserve import --gguf`: GGUF files → our checkpoints, checked against transformers'
GGUF loader (AutoModelForCausalLM / AutoTokenizer with ``gguf_file=``), a reader of the
same bytes written independently of ours, with nothing downloaded.

Files are written here (tests/gguf_files.py) from random-weight transformers models the
way llama.cpp's converter writes them, in every tensor type we import. Where
transformers' loader does not compute what llama.cpp does (llama biases, rope scaling,
tokenizer.ggml.pre, add_bos_token), the reference is the source transformers model or
llama.cpp's definition, and the difference is named. The real SmolLM2 file is used when
`make default-model` has installed it.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from model.checkpoint import load_checkpoint, read_meta
from model.default_model import default_gguf_path, install_hint
from model.gguf.reader import _Reader, dequantize
from model.gguf.to_checkpoint import import_gguf_checkpoint
from model.hf_import import ImportRefused
from model.sample import generate
from service.cli import main as cli_main
from tests.conftest import torch_threads
from tests.gguf_files import Q, TokenizerSpec, llamacpp_permute, set_tensor_type_id, write_gguf
from tests.hf_llama import CHATML, ENDOFTEXT, IM_END, IM_START

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

# Code, numbers, emoji, CJK, whitespace runs (before digits too), specials, NFC-variant
# accents: tokenized identically by ours and transformers unless a test says otherwise.
MIXED = [
    "def attention(q, k, v):\n    return softmax(q @ k.T / sqrt(d)) @ v  # scaled\n",
    "In 2024, π ≈ 3.14159 and e ≈ 2.71828; 1,000,000 tokens/s and 12345678 ids!",
    "Emoji: 🤗🚀✨👩‍💻 — “quotes” and naïve café, cafe\u0301",
    "中文：你好，世界。日本語：こんにちは。한국어: 안녕하세요",
    "  leading spaces\ttabs\t\tand\n\n\nnewlines   trailing   ",
    f"{IM_START}system\nYou are helpful.{IM_END}\n{IM_START}user\nhi{IM_END}{ENDOFTEXT}",
    "I'm sure they'll say it's DONE'S fine; 'quoted' words",
    "x  1\n\n2.   3\t\t4\n    5: return 0",
    "",
]
WHITESPACE_BEFORE_DIGIT = re.compile(r"\s{2,}\d")


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


@dataclass(frozen=True)
class Case:
    family: str  # llama | qwen2 | qwen3 | gpt2
    types: tuple[Any, ...]  # matrices take these in turn
    overrides: dict[str, Any] = field(default_factory=dict)  # of the transformers config


# Block quants need inner dims that are multiples of 32, K-quants of 256.
SMALL = {"hidden_size": 128, "intermediate_size": 96}  # 4 heads of 32, 2 KV heads
K_SIZED = {"hidden_size": 256, "intermediate_size": 512}  # 4 heads of 64
GEMMA3_LAYERS = {"num_hidden_layers": 6, "sliding_window": 5,
                 "layer_types": [*["sliding_attention"] * 5, "full_attention"]}
CASES = {
    "llama-f32": Case("llama", (Q.F32,), SMALL),
    "llama-f16-bf16": Case("llama", (Q.F16, Q.BF16), SMALL),
    "llama-blocks": Case("llama", (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1), SMALL),
    "llama-kquants-tied": Case("llama", (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K),
                               {**K_SIZED, "tie_word_embeddings": True}),
    "qwen2-blocks": Case("qwen2", (Q.Q8_0, Q.Q4_1, Q.F16), SMALL),
    "qwen2-kquants-untied": Case("qwen2", (Q.Q4_K, Q.Q6_K, Q.Q3_K),
                                 {**K_SIZED, "tie_word_embeddings": False}),
    # heads of 128 (Qwen3Config's default, which transformers' GGUF loader assumes: it
    # ignores qwen3.attention.key_length) over a width of 128: Q 4x d_model
    "qwen3-blocks": Case("qwen3", (Q.Q8_0, Q.Q4_1, Q.F16), {**SMALL, "head_dim": 128}),
    # heads of 64, read from the file's key_length: checked against the source model
    "qwen3-f32-wide": Case("qwen3", (Q.F32,), {**SMALL, "head_dim": 64}),
    # llama.cpp's smollm3 leaves rotary out of every fourth layer, whatever the file says
    "smollm3-f32": Case("smollm3", (Q.F32,), {**SMALL, "num_hidden_layers": 4,
                                              "no_rope_layers": [1, 1, 1, 0]}),
    # a llama file with llama.attention.sliding_window (Mistral's window of 5)
    "mistral-f32": Case("mistral", (Q.F32,), SMALL),
    # Phi-3: attn_qkv and ffn_up (gate | up) fused, GQA so Q/K/V are of unequal rows; no
    # window here (transformers' GGUF loader ignores phi3.attention.sliding_window) ...
    "phi3-blocks": Case("phi3", (Q.Q8_0, Q.Q4_1, Q.F16), {**SMALL, "sliding_window": None}),
    # ... and a file with a window of 6, which llama.cpp runs without it: so do we
    "phi3-f32-window": Case("phi3", (Q.F32,), SMALL),
    # Phi-3.5's LongRoPE: rope_factors_long / _short tensors and the attention factor
    "phi3-f32-longrope": Case("phi3", (Q.F32,), {
        **SMALL, "sliding_window": None, "max_position_embeddings": 512,
        "original_max_position_embeddings": 64,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0 + i / 16 for i in range(16)],
                         "long_factor": [4.0 + i for i in range(16)]}}),
    # Phi-4-mini's partial rotary: rope.dimension_count 16 of heads of 32
    "phi3-f32-partial": Case("phi3", (Q.F32,), {**SMALL, "partial_rotary_factor": 0.5,
                                                "sliding_window": None}),
    # Gemma 3 as llama.cpp runs a file: of 6 layers the first 5 windowed (its fixed period),
    # the query scale 1/√head_dim (the file holds none), the window layers' own rotary base
    # (rope.freq_base_swa); the norms hold (1 + w). Heads of 256, transformers' default
    # query_pre_attn_scalar, so that its GGUF loader computes what llama.cpp does ...
    "gemma3-blocks": Case("gemma3", (Q.Q8_0, Q.Q4_1, Q.F16), {
        **SMALL, **GEMMA3_LAYERS, "head_dim": 256, "query_pre_attn_scalar": 256,
        "rope_local_base_freq": 10000.0}),
    # ... and heads of 32 with another local base, checked against the source model
    "gemma3-f32": Case("gemma3", (Q.F32,), {
        **SMALL, **GEMMA3_LAYERS, "head_dim": 32, "query_pre_attn_scalar": 32,
        "rope_local_base_freq": 500.0}),
    "gpt2-f32": Case("gpt2", (Q.F32,)),
    # transformers reads GGUF GPT-2 with n_positions 1024 whatever the file says.
    "gpt2-quants-untied": Case("gpt2", (Q.Q8_0, Q.Q5_0, Q.BF16),
                               {"tie_word_embeddings": False}),
}


def build_hf(out: Path, family: str, **overrides: Any) -> Path:
    """A random-weight transformers model directory with a ChatML byte-level BPE."""
    if family == "gpt2":
        from tests.hf_gpt2 import build_hf_model as build_gpt2

        config = {"n_positions": 1024, "n_embd": 64, **overrides}
        return build_gpt2(out, "tokenizer.json", seed=1, **config)
    from tests.hf_llama import build_hf_model as build_llama

    build_llama(out, family, seed=1, **overrides)  # type: ignore[arg-type]
    return out


def tokenizer_spec(family: str) -> TokenizerSpec:
    if family == "gpt2":
        return TokenizerSpec(pre="gpt-2", bos=ENDOFTEXT, eos=ENDOFTEXT)
    if family in ("qwen2", "qwen3"):  # Qwen3 ships Qwen2's tokenizer; the others Llama's
        return TokenizerSpec(pre="qwen2", eos=IM_END, pad=ENDOFTEXT, eot=ENDOFTEXT,
                             chat_template=CHATML)
    # transformers' Llama tokenizer prepends bos whatever the file says: say so here.
    return TokenizerSpec(pre="gpt-2", bos=IM_START, eos=IM_END, pad=IM_END, add_bos=True,
                         chat_template=CHATML)


@dataclass(frozen=True)
class Built:
    hf_dir: Path
    gguf: Path
    ckpt: Path


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Built]:
    """case name → its transformers directory, GGUF file and our import, built once."""
    cache: dict[str, Built] = {}

    def get(name: str) -> Built:
        if name not in cache:
            case, root = CASES[name], tmp_path_factory.mktemp(name)
            hf_dir = build_hf(root / "hf", case.family, **case.overrides)
            (root / "gguf").mkdir()
            path = write_gguf(hf_dir, root / "gguf" / "model.gguf", case.types,
                              tokenizer_spec(case.family))
            cache[name] = Built(hf_dir, path, import_gguf_checkpoint(path, root / "ckpt"))
        return cache[name]

    return get


def transformers_from_gguf(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32,
        attn_implementation="eager").eval()


def transformers_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def assert_same_logits(ours: Any, theirs: Any, ids: torch.Tensor) -> None:
    """Float32 logits equal up to reordering error, which grows with their magnitude:
    1e-4 up to |logits| 10, then 1e-5 of the largest (SmolLM2: 3.6e-4 allowed, 5e-5 seen)."""
    with torch.no_grad():
        a, b = ours(ids).logits, theirs(ids).logits  # (B, T, V)
    assert a.shape == b.shape
    bound = 1e-5 * max(10.0, float(b.abs().max()))
    assert float((a - b).abs().max()) <= bound, (float((a - b).abs().max()), bound)


def assert_same_greedy(ours: Any, theirs: Any, ids: torch.Tensor, n: int,
                       eos: int | None) -> list[int]:
    """Greedy continuations of one prompt equal, up to and including eos; ours returned."""
    def upto_eos(tokens: list[int]) -> list[int]:
        return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens

    mine = generate(ours, ids, n, greedy=True, eos_token_id=eos).new_tokens(ids.shape[1])
    with torch.no_grad():  # transformers stops at the eos of the file's metadata
        ref = theirs.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=eos,
                              pad_token_id=eos if eos is not None else 0)
    assert upto_eos(mine[0].tolist()) == upto_eos(ref[0, ids.shape[1]:].tolist())
    return upto_eos(mine[0].tolist())


# files transformers' GGUF loader (4.57) cannot read: Qwen3 heads of another width than 128
# (it ignores qwen3.attention.key_length), SmolLM3 (no loader) and a llama or phi3 file's
# sliding window (ignored)
SOURCE_CHECKED = ("qwen3-f32-wide", "smollm3-f32", "mistral-f32", "phi3-f32-window",
                  "phi3-f32-partial", "phi3-f32-longrope", "gemma3-f32")


@pytest.mark.parametrize("name", [name for name in CASES if name not in SOURCE_CHECKED])
def test_logits_and_greedy_match_transformers_gguf_loader(
        built: Callable[[str], Built], name: str) -> None:
    b = built(name)
    ours, theirs = load_checkpoint(b.ckpt).model, transformers_from_gguf(b.gguf)
    vocab = theirs.config.vocab_size
    hf_config = json.loads((b.hf_dir / "config.json").read_text("utf-8"))
    assert ours.config.vocab_size == vocab
    assert ours.config.tie_weights == hf_config.get("tie_word_embeddings", True)
    ids = torch.randint(0, vocab, (2, 20), generator=torch.Generator().manual_seed(0))
    assert_same_logits(ours, theirs, ids)
    assert_same_greedy(ours, theirs, ids[:1, :8], 8, read_meta(b.ckpt).tokenizer["eos_token_id"])


@pytest.mark.parametrize("name", SOURCE_CHECKED)
def test_files_transformers_cannot_load_match_their_source_model(
        built: Callable[[str], Built], name: str) -> None:
    """Qwen3 heads wider than d_model / n_heads, from the file's attention.key_length, and
    SmolLM3's layers without rotary: the reference is the transformers model the float32
    file was written from."""
    from tests.hf_llama import load_hf_model

    b = built(name)
    ours, theirs = load_checkpoint(b.ckpt).model, load_hf_model(b.hf_dir)
    if name == "phi3-f32-window":  # llama.cpp's src/models/phi3.cpp disables Phi's window
        assert theirs.config.sliding_window == 6 and ours.config.sliding_window is None
        theirs.config.sliding_window = None
    if name == "qwen3-f32-wide":
        assert (ours.config.head_dim, ours.config.attention_width, ours.config.d_model) == (
            64, 256, 128)
    elif name == "smollm3-f32":
        assert ours.config.nope_layers == (3,)
    elif name == "mistral-f32":
        assert ours.config.sliding_window == 5
    elif name == "phi3-f32-partial":
        assert (ours.config.rotary_dims, ours.config.head_dim) == (16, 32)
    elif name == "phi3-f32-longrope":  # served with the short factors up to 64 positions
        assert ours.config.max_seq_len == 64 and ours.config.rope_scaling is not None
    elif name == "gemma3-f32":
        assert (ours.config.window_layers, ours.config.sliding_window,
                ours.config.local_rope_theta, ours.config.attn_scale) == (
            (0, 1, 2, 3, 4), 5, 500.0, 32 ** -0.5)
    ids = torch.randint(0, ours.config.vocab_size, (2, 20),
                        generator=torch.Generator().manual_seed(0))
    assert_same_logits(ours, theirs, ids)
    assert_same_greedy(ours, theirs, ids[:1, :8], 8, read_meta(b.ckpt).tokenizer["eos_token_id"])


GLOBAL = {"token_embd": "tok_emb", "position_embd": "pos_emb", "output_norm": "ln_f",
          "output": "lm_head"}
BLOCK = {"attn_norm": "ln_1", "ffn_norm": "ln_2", "attn_q": "attn.w_q", "attn_k": "attn.w_k",
         "attn_v": "attn.w_v", "attn_output": "attn.w_o", "ffn_gate": "ffn.gate",
         "ffn_up": "ffn.up", "ffn_down": "ffn.down", "attn_q_norm": "attn.q_norm",
         "attn_k_norm": "attn.k_norm", "post_attention_norm": "post_attn",
         "post_ffw_norm": "post_ffn"}


def our_names(gguf_name: str, family: str = "") -> list[str]:
    """GGUF tensor name → model.gpt.GPT's (gpt2's and phi3's attn_qkv hold Q, K and V,
    phi3's ffn_up the gate and up projections)."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in GLOBAL:
        return [f"{GLOBAL[base]}.{suffix}"]
    _, layer, part = base.split(".")
    if part == "attn_qkv":
        return [f"blocks.{layer}.attn.{w}.{suffix}" for w in ("w_q", "w_k", "w_v")]
    if family == "phi3" and part == "ffn_up":
        return [f"blocks.{layer}.ffn.{w}.{suffix}" for w in ("gate", "up")]
    return [f"blocks.{layer}.{BLOCK[part]}.{suffix}"]


@pytest.mark.parametrize("name", ["llama-blocks", "llama-kquants-tied", "qwen2-kquants-untied",
                                  "qwen3-blocks", "phi3-blocks", "gemma3-blocks",
                                  "gpt2-quants-untied"])
def test_weights_are_llamacpps_dequantisation_of_the_raw_blocks(
        built: Callable[[str], Built], name: str) -> None:
    """Our tensors, put back in llama.cpp's layout, equal gguf.quants.dequantize exactly."""
    b, family = built(name), CASES[name].family
    model = load_checkpoint(b.ckpt).model
    state, cfg = model.state_dict(), model.config
    for t in gguf.GGUFReader(b.gguf).tensors:
        ours = np.concatenate([state[n].numpy() for n in our_names(t.name, family)])
        if family == "llama" and ".attn_q." in t.name:
            ours = llamacpp_permute(ours, cfg.n_heads)
        if family == "llama" and ".attn_k." in t.name:
            ours = llamacpp_permute(ours, cfg.n_heads, cfg.kv_heads)
        np.testing.assert_array_equal(ours, gguf.quants.dequantize(t.data, t.tensor_type),
                                      err_msg=t.name)
    counts = read_meta(b.ckpt).training["imported_from"]["tensor_types"]
    assert {t.name for t in CASES[name].types} <= set(counts)


@pytest.mark.parametrize("name", ["llama-f32", "qwen2-blocks", "gpt2-f32"])
def test_tokenizer_ids_match_transformers_gguf_tokenizer(
        built: Callable[[str], Built], name: str) -> None:
    from tokenizers import Tokenizer

    b = built(name)
    ours, theirs = Tokenizer.from_file(str(b.ckpt / "tokenizer.json")), transformers_tokenizer(
        b.gguf)
    for text in MIXED:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special).ids == theirs(
                text, add_special_tokens=special)["input_ids"], (text, special)
        ids = ours.encode(text, add_special_tokens=False).ids
        expected = text
        if CASES[name].family == "qwen2":  # Qwen2 normalises to NFC, as its tokenizer.json
            import unicodedata

            expected = unicodedata.normalize("NFC", text)
        assert ours.decode(ids, skip_special_tokens=False) == expected


def test_added_tokens_bos_and_eos_follow_the_file(built: Callable[[str], Built],
                                                  tmp_path: Path) -> None:
    """USER_DEFINED tokens are matched whole but are not special; Llama 3's pre-tokenizer
    prepends bos unless the file says otherwise (llama.cpp); add_eos_token appends eos."""
    from tokenizers import Tokenizer

    spec = TokenizerSpec(pre="llama-bpe", bos=ENDOFTEXT, eos=IM_END, user_defined=(IM_START,))
    path = write_gguf(built("llama-f32").hf_dir, tmp_path / "m.gguf", tokenizer=spec,
                      metadata={"tokenizer.ggml.add_eos_token": True})
    ckpt = import_gguf_checkpoint(path, tmp_path / "ckpt")
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    vocab = tok.get_vocab()
    ids = tok.encode(f"hi{IM_START}there{IM_END}").ids
    assert ids[0] == vocab[ENDOFTEXT] and ids[-1] == vocab[IM_END]
    assert vocab[IM_START] in ids and ids.count(vocab[IM_END]) == 2
    assert tok.decode(ids) == f"hi{IM_START}there"  # specials skipped, user-defined kept
    tok_config = json.loads((ckpt / "tokenizer_config.json").read_text("utf-8"))
    assert tok_config["add_bos_token"] is True and tok_config["add_eos_token"] is True


def test_side_files_give_the_chat_route_its_template_and_stops(
        built: Callable[[str], Built]) -> None:
    from service.contract.chat_template import ChatTemplate

    ckpt = built("qwen2-blocks").ckpt
    assert (ckpt / "chat_template.jinja").read_text("utf-8") == CHATML
    tok_config = json.loads((ckpt / "tokenizer_config.json").read_text("utf-8"))
    assert tok_config["eos_token"] == IM_END and tok_config["pad_token"] == ENDOFTEXT
    assert tok_config["bos_token"] is None and tok_config["add_bos_token"] is False
    assert tok_config["model_max_length"] == 128 and "chat_template" not in tok_config
    generation = json.loads((ckpt / "generation_config.json").read_text("utf-8"))
    meta = read_meta(ckpt)
    vocab = json.loads((ckpt / "tokenizer.json").read_text("utf-8"))["model"]["vocab"]
    # <|im_end|> (eos) first, then the end-of-turn id the file declares (<|endoftext|>).
    assert generation == {"bos_token_id": None, "pad_token_id": vocab[ENDOFTEXT],
                          "eos_token_id": [vocab[IM_END], vocab[ENDOFTEXT]]}
    assert meta.tokenizer["eos_token_id"] == vocab[IM_END]
    template = ChatTemplate.load(ckpt, {})
    assert template.origin == "chat_template.jinja"
    assert template.render([{"role": "user", "content": "hi"}]).endswith(
        f"{IM_START}user\nhi{IM_END}\n{IM_START}assistant\n")
    imported = meta.training["imported_from"]
    assert imported["format"] == "gguf" and imported["architecture"] == "qwen2"
    assert imported["name"] == "attnserve-test-qwen2" and imported["tokenizer_pre"] == "qwen2"


@pytest.mark.parametrize(("overrides", "rope"), [
    # Llama 3's scaling: llama.cpp writes it as a rope_freqs tensor (transformers' GGUF
    # loader ignores that tensor, so the source model is the reference).
    ({"rope_theta": 500000.0, "max_position_embeddings": 256,
      "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
     "llama3"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "linear"),
    # Biases on all attention and SwiGLU projections (llama.cpp loads them when present).
    ({"attention_bias": True, "mlp_bias": True}, None),
])
def test_llama_options_match_the_source_model(tmp_path: Path, overrides: dict[str, Any],
                                              rope: str | None) -> None:
    from tests.hf_llama import load_hf_model

    hf_dir = build_hf(tmp_path / "hf", "llama", **SMALL, **overrides)
    path = write_gguf(hf_dir, tmp_path / "model.gguf", (Q.F32,), tokenizer_spec("llama"))
    ckpt = load_checkpoint(import_gguf_checkpoint(path, tmp_path / "ckpt"))
    scaling = ckpt.model.config.rope_scaling
    assert (scaling or {}).get("rope_type") == rope
    if rope is not None:
        assert scaling == overrides["rope_scaling"]
    ids = torch.randint(0, 400, (2, 20), generator=torch.Generator().manual_seed(0))
    assert_same_logits(ckpt.model, load_hf_model(hf_dir), ids)


def test_named_pre_tokenizers_split_as_llamacpp_defines_them() -> None:
    """llama.cpp's regex_exprs (src/llama-vocab.cpp): smollm isolates every digit first,
    Llama 3 groups digits by three and keeps newline runs whole."""
    from model.gguf.vocab import PRE_TOKENIZERS, GGUFVocab, build_tokenizer

    def pieces(pre: str, text: str) -> list[str]:
        vocab = GGUFVocab(tokens=["a"], token_types=[1], merges=[], pre_name=pre,
                          pre=PRE_TOKENIZERS[pre], special={}, stop_ids=[], add_bos=False,
                          add_eos=False, chat_template=None)
        return [p for p, _ in build_tokenizer(vocab).pre_tokenizer.pre_tokenize_str(text)]

    assert pieces("smollm", "x  2024 3.14") == ["x", "ĠĠ", "2", "0", "2", "4", "Ġ", "3", ".",
                                                "1", "4"]
    assert pieces("gpt-2", "x  2024 3.14") == ["x", "Ġ", "Ġ2024", "Ġ3", ".", "14"]
    assert pieces("llama-bpe", "12345 I'm\n\n\nok") == ["123", "45", "ĠI", "'m", "ĊĊĊ", "ok"]
    assert pieces("qwen2", "12 I'M ok") == ["1", "2", "ĠI", "'M", "Ġok"]


# Refusals: one line, exit status 2, nothing written (no target, no staging directory).


def _refused(capsys: pytest.CaptureFixture[str], src: Path, out: Path) -> str:
    code = cli_main(["import", "--gguf", str(src), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("attnserve import: error: ")
    assert not out.exists()
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(".")]
    return err


def _variant(built: Callable[[str], Built], tmp_path: Path, case: str = "llama-blocks",
             **kwargs: Any) -> Path:
    """A case's model (llama-blocks) written again with write_gguf options changed."""
    b = built(case)
    spec = kwargs.pop("tokenizer", tokenizer_spec(CASES[case].family))
    return write_gguf(b.hf_dir, tmp_path / "variant.gguf", CASES[case].types, spec, **kwargs)


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"architecture": "mamba"}, "general.architecture 'mamba' is not supported"),
    ({"metadata": {"gemma3.final_logit_softcapping": 30.0}, "case": "gemma3-f32"},
     "final_logit_softcapping 30.0 is not supported"),
    ({"tokenizer": TokenizerSpec(model="bert", pre="default")},
     "tokenizer.ggml.model 'bert' is not supported"),
    ({"tokenizer": TokenizerSpec(pre="deepseek-coder")}, "tokenizer.ggml.pre 'deepseek-coder'"),
    ({"drop": ["blk.1.ffn_up.weight"]}, "missing ['blocks.1.ffn.up.weight']"),
    ({"metadata": {"llama.feed_forward_length": 64}},
     "blk.0.ffn_down.weight has shape [128, 96] (rows, columns), the metadata implies "
     "[128, 64]"),
    ({"metadata": {"llama.rope.dimension_count": 16}}, "partial rotary"),
    ({"metadata": {"llama.rope.scaling.type": "yarn"}}, "rope.scaling.type 'yarn'"),
    ({"metadata": {"llama.expert_count": 8}}, "mixture-of-experts"),
])
def test_unsupported_files_refused_leaving_nothing(
        built: Callable[[str], Built], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        kwargs: dict[str, Any], named: str) -> None:
    path = _variant(built, tmp_path, **kwargs)
    (tmp_path / "out").mkdir()
    assert named in _refused(capsys, path, tmp_path / "out" / "ckpt")


@pytest.mark.parametrize(("type_id", "named"), [
    (99, "tensor blk.0.attn_output.weight has unknown GGML type id 99"),
    (int(Q.IQ4_NL), "tensor blk.0.attn_output.weight has type IQ4_NL, which is not supported"),
])
def test_unsupported_tensor_types_refused_by_name(
        built: Callable[[str], Built], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        type_id: int, named: str) -> None:
    # attn_output is Q4_0 here: 18-byte blocks, IQ4_NL's size too, so only the type is wrong.
    path = _variant(built, tmp_path)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.attn_output.weight"] == Q.Q4_0
    set_tensor_type_id(path, "blk.0.attn_output.weight", type_id)
    (tmp_path / "out").mkdir()
    assert named in _refused(capsys, path, tmp_path / "out" / "ckpt")


@pytest.mark.parametrize("keep", [0.1, 0.6, 0.999])
def test_truncated_file_refused(built: Callable[[str], Built], tmp_path: Path,
                                capsys: pytest.CaptureFixture[str], keep: float) -> None:
    data = built("llama-blocks").gguf.read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[:int(len(data) * keep)])
    (tmp_path / "out").mkdir()
    assert "not a readable GGUF file" in _refused(capsys, path, tmp_path / "out" / "ckpt")


def test_non_gguf_and_non_empty_output_refused(
        built: Callable[[str], Built], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "out").mkdir()
    text = tmp_path / "model.gguf"
    text.write_text("not a model\n", "utf-8")
    assert "GGUF magic invalid" in _refused(capsys, text, tmp_path / "out" / "ckpt")
    assert "is not a file" in _refused(capsys, tmp_path / "absent.gguf",
                                       tmp_path / "out" / "ckpt")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine", "utf-8")
    good = built("llama-blocks").gguf
    with pytest.raises(ImportRefused, match="not empty"):
        import_gguf_checkpoint(good, taken)
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
    assert import_gguf_checkpoint(good, taken, force=True) == taken
    assert not (taken / "keep.txt").exists() and (taken / "model.gguf").is_file()


def test_cli_imports_and_takes_exactly_one_source(
        built: Callable[[str], Built], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    b = built("gpt2-f32")
    assert cli_main(["import", "--gguf", str(b.gguf), "--out", str(tmp_path / "c")]) == 0
    assert "imported" in capsys.readouterr().out
    assert read_meta(tmp_path / "c").model == read_meta(b.ckpt).model
    with pytest.raises(SystemExit) as exc:
        cli_main(["import", "--gguf", str(b.gguf), "--hf", str(b.hf_dir), "--out",
                  str(tmp_path / "d")])
    assert exc.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_the_checkpoint_holds_the_file_and_float32_is_opt_in(built: Callable[[str], Built],
                                                            tmp_path: Path) -> None:
    """By default the checkpoint's weights are the GGUF file itself (a hard link here: the
    same inode, no bytes copied), no float32 copy; --float32 writes model.safetensors. Both
    load to gguf's dequantised weights bit for bit, and the held file keeps the checkpoint
    whole when the imported one moves away."""
    b = built("llama-blocks")
    held = b.ckpt / "model.gguf"
    assert held.is_file() and not (b.ckpt / "model.safetensors").exists()
    assert held.stat().st_ino == b.gguf.stat().st_ino
    assert cli_main(["import", "--gguf", str(b.gguf), "--out", str(tmp_path / "f32"),
                     "--float32"]) == 0
    assert sorted(p.name for p in (tmp_path / "f32").iterdir()) == sorted(
        p.name.replace("model.gguf", "model.safetensors") for p in b.ckpt.iterdir())
    reader = gguf.GGUFReader(b.gguf)
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    ref = gguf.quants.dequantize(np.asarray(embd.data), embd.tensor_type)  # (V, d)
    moved = tmp_path / "moved"
    shutil.copytree(b.ckpt, moved)  # the copy holds its own file; the source is elsewhere
    held_model = load_checkpoint(moved).model.state_dict()
    float_model = load_checkpoint(tmp_path / "f32").model.state_dict()
    assert held_model.keys() == float_model.keys()
    for name, value in held_model.items():
        assert torch.equal(value, float_model[name]), name
    assert np.array_equal(held_model["tok_emb.weight"].numpy(), ref)
    record = load_checkpoint(moved).meta.training["imported_from"]
    assert record["path"] == str(moved / "model.gguf")  # what --quantize gguf reads


def test_a_held_file_that_changed_is_refused(built: Callable[[str], Built],
                                            tmp_path: Path) -> None:
    """Another model's GGUF file in a checkpoint's place: loading names the mismatch."""
    from model.checkpoint import CheckpointError

    other = built("qwen2-blocks")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(built("llama-blocks").ckpt, ckpt)
    (ckpt / "model.gguf").unlink()
    shutil.copyfile(other.gguf, ckpt / "model.gguf")
    with pytest.raises(CheckpointError, match=re.escape("model.gguf does not match config.json")):
        load_checkpoint(ckpt)


def test_recommended_sampling_reaches_generation_config(
        built: Callable[[str], Built], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """llama.cpp's general.sampling.* keys become generation_config.json's fields (what the
    OpenAI routes fill in); --sampling overrides them; a bad pair is refused, nothing written."""
    path = _variant(built, tmp_path, metadata={"general.sampling.temp": 0.7,
                                               "general.sampling.top_k": 40})
    ckpt = import_gguf_checkpoint(path, tmp_path / "a")
    generation = json.loads((ckpt / "generation_config.json").read_text("utf-8"))
    assert generation["temperature"] == pytest.approx(0.7) and generation["top_k"] == 40
    assert cli_main(["import", "--gguf", str(path), "--out", str(tmp_path / "b"),
                     "--sampling", "temperature=0.2", "--sampling", "top_p=0.9"]) == 0
    generation = json.loads((tmp_path / "b" / "generation_config.json").read_text("utf-8"))
    assert (generation["temperature"], generation["top_p"], generation["top_k"]) == (0.2, 0.9, 40)
    assert generation["eos_token_id"] == read_meta(ckpt).tokenizer["eos_token_id"]
    capsys.readouterr()
    for bad in ("temp=0.2", "top_p=0", "temperature=hot"):
        assert cli_main(["import", "--gguf", str(path), "--out", str(tmp_path / "c"),
                         "--sampling", bad]) == 2
        assert bad in capsys.readouterr().err and not (tmp_path / "c").exists()


def test_fast_string_array_reader_equals_ggufreader(built: Callable[[str], Built],
                                                    tmp_path: Path) -> None:
    """_Reader parses string arrays its own way; every field must be what gguf's is."""
    path = _variant(built, tmp_path, metadata={"test.one": ["é"]})
    ours, stock = _Reader(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(stock.fields)
    for key, mine in ours.fields.items():
        theirs = stock.fields[key]
        assert (mine.types, mine.data, mine.offset) == (theirs.types, theirs.data, theirs.offset)
        assert len(mine.parts) == len(theirs.parts), key
        for a, b in zip(mine.parts, theirs.parts, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b), key
    assert [t.name for t in ours.tensors] == [t.name for t in stock.tensors]
    assert all(np.array_equal(dequantize(t).numpy(), gguf.quants.dequantize(s.data, s.tensor_type))
               for t, s in zip(ours.tensors, stock.tensors, strict=True))


# The real SmolLM2-135M-Instruct (Q4_1 + Q8_0 + F32) when `make default-model` put it here.

PROMPTS = ["The capital of France is",
           f"{IM_START}user\nWhat is the capital of France?{IM_END}\n{IM_START}assistant\n",
           "def fibonacci(n):\n    "]


@pytest.fixture(scope="module")
def real_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real file, linked alone into a directory (transformers reads the directory)."""
    src = default_gguf_path()
    if not src.is_file():
        pytest.skip(f"SmolLM2 GGUF not installed at {src}: {install_hint()}")
    link = tmp_path_factory.mktemp("smollm2-gguf") / src.name
    link.symlink_to(src.resolve())
    return link


@pytest.fixture(scope="module")
def real_transformers(smollm2_transformers: tuple[Any, Any]) -> Any:
    """transformers' model from the same file (tests/conftest.py: loaded once a session)."""
    return smollm2_transformers[0]


def test_real_smollm2_import_metadata(smollm2_checkpoint: Path) -> None:
    meta = read_meta(smollm2_checkpoint)
    cfg = meta.model
    assert (cfg.arch, cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.vocab_size,
            cfg.max_seq_len, cfg.rope_theta, cfg.tie_weights) == (
        "llama", 30, 576, 9, 3, 49152, 8192, 100000.0, True)
    assert meta.tokenizer == {"kind": "bpe", "pad_token_id": 2, "bos_token_id": 1,
                              "eos_token_id": 2}
    assert meta.training["imported_from"]["tensor_types"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert "<|im_start|>" in (smollm2_checkpoint / "chat_template.jinja").read_text("utf-8")


def test_real_smollm2_tokenizer_matches_transformers_but_whitespace_before_digits(
        smollm2_checkpoint: Path, real_gguf: Path) -> None:
    """SmolLM2's file names pre-tokenizer ``smollm``: every digit its own piece before the
    GPT-2 regex (llama.cpp; SmolLM2's own tokenizer.json: Digits then ByteLevel).
    transformers' GGUF loader uses GPT-2's regex alone, so a whitespace run before a digit
    splits differently: "x  1" is ["x", "ĠĠ", "1"] here and ["x", "Ġ", "Ġ", "1"] there.
    Everywhere else the ids are transformers'; and everywhere they are those of
    transformers' tokenizer given SmolLM2's own pre-tokenizer. transformers also prepends
    bos although the file says add_bos_token = false; ours does not."""
    from tokenizers import Tokenizer
    from tokenizers import pre_tokenizers as pre

    from tests.hf_gpt2 import sample_texts

    ours = Tokenizer.from_file(str(smollm2_checkpoint / "tokenizer.json"))
    theirs = transformers_tokenizer(real_gguf)
    original = Tokenizer.from_str(theirs.backend_tokenizer.to_str())
    original.pre_tokenizer = pre.Sequence([pre.Digits(individual_digits=True),
                                           pre.ByteLevel(add_prefix_space=False)])
    differ = []
    for text in [*MIXED, *PROMPTS, *sample_texts(40_000)]:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ours.encode(text).ids == ids  # no bos: add_bos_token is false
        assert ids == original.encode(text, add_special_tokens=False).ids, text
        if ids != theirs(text, add_special_tokens=False)["input_ids"]:
            assert WHITESPACE_BEFORE_DIGIT.search(text), text
            differ.append(text)
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode("x  1").tokens == ["x", "ĠĠ", "1"]


def test_real_smollm2_logits_and_greedy_match_transformers(
        smollm2_checkpoint: Path, real_transformers: Any) -> None:
    from tokenizers import Tokenizer

    ckpt = load_checkpoint(smollm2_checkpoint)
    tokenizer = Tokenizer.from_file(str(smollm2_checkpoint / "tokenizer.json"))
    eos = ckpt.meta.tokenizer["eos_token_id"]
    answers = []
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt).ids])
        assert_same_logits(ckpt.model, real_transformers, ids)
        answers.append(assert_same_greedy(ckpt.model, real_transformers, ids, 16, eos))
    assert len(answers[0]) == 16  # a full 16 greedy tokens, no early stop
    assert answers[1][-1] == eos and "Paris" in tokenizer.decode(answers[1])

