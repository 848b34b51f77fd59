"""The tokenizer a GGUF file carries in its metadata, rebuilt with the `tokenizers` library.

llama.cpp stores the vocabulary as ``tokenizer.ggml.*`` keys: the algorithm
(``model``: ``gpt2`` is byte-level BPE, ``llama`` SentencePiece), the tokens with their
types, the merges, the special ids, and the pre-tokenizer by name (``pre``), which
llama.cpp's src/llama-vocab.cpp maps to a sequence of split regexes. The same sequence
becomes a ``Split`` pre-tokenizer per regex followed by the byte-level mapping, so the
service tokenizes as llama.cpp does, which is how the model's own tokenizer.json did.

transformers' GGUF loader builds its tokenizer differently in places (the tests pin
each difference): for ``general.architecture = llama`` it ignores ``pre`` and always uses
GPT-2's regex (so SmolLM2's digit splitting and Llama 3's 1-3 digit groups are lost), it
prepends bos whatever ``add_bos_token`` says, and it adds no USER_DEFINED tokens; for
``qwen2`` it adds only the three ChatML specials. Qwen2's NFC normalisation is kept, as
in Qwen2's tokenizer.json and transformers (llama.cpp does not normalise).

``model = llama`` is SentencePiece (Llama 2, Mistral, Phi-3, Gemma): llama.cpp's
llm_tokenizer_spm escapes spaces as U+2581, prepends one to every run of text that starts
the input or follows a special token (``add_space_prefix``, on unless the file says
otherwise), and merges, over and over, the adjacent pair whose joined piece has the highest
score, spelling pieces the vocabulary lacks as their UTF-8 bytes (``<0xNN>`` tokens). That
is a BPE whose merges are ranked by the joined piece's score (as transformers' and
SentencePiece's own converters build it), with byte fallback; the space prefix becomes a
normaliser, which the ``tokenizers`` library applies to each run between added tokens, as
llama.cpp does. Other models are refused with one line. Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors
from tokenizers import pre_tokenizers as pre

from model.hf_import import ImportRefused

# GPT-2's pattern as tokenizers' ByteLevel(use_regex=True) spells it (llama.cpp's custom
# GPT-2 splitter has the same trailing-whitespace rule).
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# llama.cpp's token types (gguf.TokenType): CONTROL tokens are special (<|im_start|>),
# USER_DEFINED ones are matched whole in text but are not special.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
SPACE = "\u2581"  # SentencePiece's visible space


@dataclass(frozen=True)
class PreTokenizer:
    """One ``tokenizer.ggml.pre`` name as llama.cpp's llm_tokenizer_bpe defines it."""

    splits: tuple[str, ...]  # regexes applied in turn, each match its own piece
    nfc: bool = False  # normalise to NFC first (Qwen2's tokenizer.json)
    ignore_merges: bool = False  # a piece already in the vocabulary is one token (Llama 3)
    add_bos: bool = False  # llama.cpp's default when add_bos_token is not in the file


_LLAMA3 = PreTokenizer((LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "gpt-2": PreTokenizer((GPT2_SPLIT,)),
    # SmolLM's tokenizer.json: Digits(individual_digits) before the byte-level regex.
    "smollm": PreTokenizer((r"\p{N}", GPT2_SPLIT)),
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3,
    "qwen2": PreTokenizer((QWEN2_SPLIT,), nfc=True),
}
# Files written before llama.cpp named pre-tokenizers (and "default") get GPT-2's regex,
# as transformers does; llama.cpp's own "default" splits punctuation runs first.
DEFAULT_PRE = "gpt-2"


@dataclass(frozen=True)
class GGUFVocab:
    """The ``tokenizer.*`` metadata of a GGUF file, checked."""

    tokens: list[str]
    token_types: list[int]
    merges: list[tuple[str, str]]  # byte-level BPE; empty for SentencePiece
    pre_name: str
    pre: PreTokenizer
    special: dict[str, int | None]  # bos/eos/pad/unk_token_id
    stop_ids: list[int]  # eos, then end-of-turn / end-of-message ids when declared
    add_bos: bool
    add_eos: bool
    chat_template: str | None
    scores: list[float] | None = None  # SentencePiece: each piece's score (merge priority)
    add_space_prefix: bool = True  # SentencePiece: a U+2581 before each run of text

    def token(self, key: str) -> str | None:
        token_id = self.special.get(key)
        return None if token_id is None else self.tokens[token_id]


def _special_ids(meta: Mapping[str, Any], n_tokens: int,
                 refuse: Callable[[str], ImportRefused]) -> dict[str, int | None]:
    """tokenizer.ggml.{bos,eos,padding,unknown,eot,eom}_token_id, each a token or None."""
    ids: dict[str, int | None] = {}
    for name in ("bos", "eos", "padding", "unknown", "eot", "eom"):
        value = meta.get(f"tokenizer.ggml.{name}_token_id")
        if value is not None and not 0 <= int(value) < n_tokens:
            raise refuse(f"tokenizer.ggml.{name}_token_id {value} is not one of the "
                         f"{n_tokens} tokens")
        ids[name] = None if value is None else int(value)
    return ids


def read_vocab(meta: Mapping[str, Any], where: str) -> GGUFVocab:
    """Check the tokenizer metadata and return it; ImportRefused names what is missing."""
    def refuse(reason: str) -> ImportRefused:
        return ImportRefused(f"{where}: {reason}")

    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise refuse("has no tokenizer (tokenizer.ggml.model is missing)")
    if kind not in ("gpt2", "llama"):
        raise refuse(f"tokenizer.ggml.model {kind!r} is not supported; only byte-level BPE "
                     "('gpt2') and SentencePiece ('llama') are")
    spm = kind == "llama"
    pre_name = str(meta.get("tokenizer.ggml.pre", DEFAULT_PRE))
    pre_name = DEFAULT_PRE if pre_name == "default" or spm else pre_name
    if pre_name not in PRE_TOKENIZERS:
        raise refuse(f"tokenizer.ggml.pre {pre_name!r} is not supported (one of "
                     f"{sorted(PRE_TOKENIZERS)})")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise refuse("has no token list (tokenizer.ggml.tokens)")
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise refuse(f"{len(types)} token types for {len(tokens)} tokens")
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges") or []]
    bad = [" ".join(m) for m in merges if len(m) != 2]
    if not spm and (not merges or bad):
        raise refuse(f"tokenizer.ggml.merges is missing or malformed ({bad[:2]})")
    scores = meta.get("tokenizer.ggml.scores")
    if spm and (not isinstance(scores, list) or len(scores) != len(tokens)):
        raise refuse("a SentencePiece vocabulary needs a score per token "
                     "(tokenizer.ggml.scores)")
    ids = _special_ids(meta, len(tokens), refuse)
    # llama.cpp stops at any end-of-generation token: eos, end of turn, end of message.
    stops = list(dict.fromkeys(i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None))
    pre_tokenizer = PRE_TOKENIZERS[pre_name]
    template = meta.get("tokenizer.chat_template")
    return GGUFVocab(
        tokens=tokens, token_types=[int(t) for t in types],
        merges=[(a, b) for a, b in merges], pre_name=pre_name, pre=pre_tokenizer,
        special={"bos_token_id": ids["bos"], "eos_token_id": stops[0] if stops else None,
                 "pad_token_id": ids["padding"], "unk_token_id": ids["unknown"]},
        stop_ids=stops,
        # llama.cpp: SentencePiece vocabularies add bos unless the file says not to
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", spm or pre_tokenizer.add_bos)),
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=template if isinstance(template, str) else None,
        scores=[float(s) for s in scores] if spm and isinstance(scores, list) else None,
        add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)))


def _post_processor(vocab: GGUFVocab) -> Any:
    """Prepend bos / append eos as llama.cpp does when the file asks (TemplateProcessing)."""
    bos, eos = vocab.special.get("bos_token_id"), vocab.special.get("eos_token_id")
    head = [bos] if vocab.add_bos and bos is not None else []
    tail = [eos] if vocab.add_eos and eos is not None else []
    if not head and not tail:
        return None if vocab.scores is not None else processors.ByteLevel(trim_offsets=False)

    def spell(ids: list[int], seq: int) -> list[str]:
        return [f"{vocab.tokens[i]}:{seq}" for i in ids]

    single = [*spell(head, 0), "$A:0", *spell(tail, 0)]
    pair = [*single, *spell(head, 1), "$B:1", *spell(tail, 1)]
    return processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair),
        special_tokens=[(vocab.tokens[i], i) for i in dict.fromkeys(head + tail)])


def spm_merges(vocab: GGUFVocab) -> list[tuple[str, str]]:
    """SentencePiece's merge order as BPE merges: every split of a NORMAL piece into two
    pieces of the vocabulary, the joined piece's score first (highest first), then the
    halves' ids, as transformers' SentencePieceExtractor orders them."""
    assert vocab.scores is not None
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    ranked = []
    for token, score, kind in zip(vocab.tokens, vocab.scores, vocab.token_types, strict=True):
        if kind != NORMAL:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-score, ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _spm_tokenizer(vocab: GGUFVocab, ids: dict[str, int], unk: str | None) -> Tokenizer:
    """llama.cpp's SentencePiece (module docstring) as a ``tokenizers`` BPE."""
    tokenizer = Tokenizer(models.BPE(ids, spm_merges(vocab), unk_token=unk, fuse_unk=True,
                                     byte_fallback=True))
    escape = [normalizers.Replace(" ", SPACE)]
    if vocab.add_space_prefix:
        escape.insert(0, normalizers.Prepend(SPACE))
    tokenizer.normalizer = normalizers.Sequence(escape)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def build_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    """Byte-level BPE with llama.cpp's pre-tokenizer, or SentencePiece; CONTROL and
    USER_DEFINED tokens as added tokens."""
    ids = {token: i for i, token in enumerate(vocab.tokens)}  # duplicates: the last id wins
    unk = vocab.token("unk_token_id")
    if vocab.scores is not None:
        tokenizer = _spm_tokenizer(vocab, ids, unk)
    else:
        tokenizer = Tokenizer(models.BPE(ids, vocab.merges, unk_token=unk,
                                         ignore_merges=vocab.pre.ignore_merges))
        if vocab.pre.nfc:
            tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre.Sequence(
            [pre.Split(Regex(r), behavior="isolated") for r in vocab.pre.splits]
            + [pre.ByteLevel(add_prefix_space=False, use_regex=False)])
        tokenizer.decoder = decoders.ByteLevel()
    post = _post_processor(vocab)
    if post is not None:
        tokenizer.post_processor = post
    tokenizer.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(vocab.tokens, vocab.token_types, strict=True) if kind == CONTROL])
    tokenizer.add_tokens([
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(vocab.tokens, vocab.token_types, strict=True) if kind == USER_DEFINED])
    return tokenizer


def checkpoint_special_ids(vocab: GGUFVocab) -> dict[str, int | None]:
    """What config.json's tokenizer section declares (no unk: the engine never needs it)."""
    return {k: vocab.special.get(k) for k in ("pad_token_id", "bos_token_id", "eos_token_id")}


def side_files(vocab: GGUFVocab, context_length: int) -> dict[str, bytes]:
    """chat_template.jinja, tokenizer_config.json and generation_config.json: the files the
    chat route and the stop logic read from an artifact (service/contract/chat_template.py,
    service/artifact/loader.py), as a Hugging Face snapshot of the model would have them."""
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{name: vocab.token(f"{name}_id")
           for name in ("bos_token", "eos_token", "pad_token", "unk_token")},
        "add_bos_token": vocab.add_bos, "add_eos_token": vocab.add_eos,
        "model_max_length": context_length, "clean_up_tokenization_spaces": False,
    }
    stops = vocab.stop_ids
    generation = {"bos_token_id": vocab.special.get("bos_token_id"),
                  "eos_token_id": stops[0] if len(stops) == 1 else (stops or None),
                  "pad_token_id": vocab.special.get("pad_token_id")}
    files = {"tokenizer_config.json": json.dumps(tokenizer_config, indent=2).encode(),
             "generation_config.json": json.dumps(generation, indent=2).encode()}
    if vocab.chat_template is not None:
        files["chat_template.jinja"] = vocab.chat_template.encode()
    return files
