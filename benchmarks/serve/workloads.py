"""Request sets for the serving benchmark, built from the served model's own tokenizer.

``random`` is vLLM's random dataset: prompts of random tokens of a given length (optionally
spread by --range-ratio), each asking for a given number of new tokens. ``shared-prefix``
is its prefix-repetition dataset: a few long prefixes (a system prompt, few-shot examples)
each shared by many requests that differ only in a short suffix, so a prefix cache can
reuse the prefix's keys and values.

Prompts go over HTTP as text, and random token ids do not survive decode → encode
unchanged under byte-level BPE, so each text is adjusted until the tokenizer gives it
exactly the asked length (a few tries; the closest is kept, and the server's own count of
prompt tokens is what the report uses). Ids are drawn from the ordinary vocabulary:
special tokens (end-of-sequence among them) never appear in a prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from service.artifact.text import REPLACEMENT, TextCodec

FIT_TRIES = 16


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens, as the benchmark's tokenizer counts them
    expected_output_len: int  # max_new_tokens asked for
    prefix_id: int | None = None  # shared-prefix: which prefix the prompt starts with
    adapter: str | None = None  # the LoRA adapter it names (None: the base model)


class PromptMaker:
    """Texts of an exact token length from random ordinary token ids."""

    def __init__(self, codec: TextCodec, rng: np.random.Generator) -> None:
        self.codec = codec
        self.rng = rng
        # Only tokens that are whole characters on their own: a lone UTF-8 fragment
        # decodes to U+FFFD, which re-encodes as three other tokens.
        self.vocab = np.asarray([i for i in range(codec.vocab_size)
                                 if i not in codec.special_ids
                                 and (piece := codec.decode([i])) and REPLACEMENT not in piece])

    def _fresh(self, n: int) -> list[int]:
        return [int(i) for i in self.rng.choice(self.vocab, size=n)]

    def text(self, n_tokens: int) -> tuple[str, int]:
        """(text, its token count): the count equals ``n_tokens`` unless FIT_TRIES fail.

        Random ids are not what the tokenizer would produce for their text, so the text is
        re-encoded (merges across the old boundaries) and then cut on the tokenizer's own
        ids, where a cut re-encodes to itself except at the boundary: try a few cuts.
        """
        ids = self._fresh(n_tokens + 8)
        best: tuple[str, int] = ("", 0)
        for _ in range(FIT_TRIES):
            got = self.codec.encode(self.codec.decode(ids))
            if len(got) < n_tokens:
                ids = got + self._fresh(n_tokens + 8 - len(got))
                continue
            for cut in (n_tokens, n_tokens - 1, n_tokens + 1, n_tokens - 2, n_tokens + 2):
                if not 1 <= cut <= len(got):
                    continue
                text = self.codec.decode(got[:cut])
                count = len(self.codec.encode(text))
                if count == n_tokens:
                    return text, count
                if not best[0] or abs(count - n_tokens) < abs(best[1] - n_tokens):
                    best = (text, count)
            ids = got[:n_tokens - 1] + self._fresh(8)
        return best


def random_requests(codec: TextCodec, num_prompts: int, input_len: int, output_len: int,
                    range_ratio: float = 0.0, seed: int = 0) -> list[SampleRequest]:
    """Lengths uniform in [len·(1−r), len·(1+r)] like vLLM's --random-range-ratio."""
    if input_len < 1 or output_len < 1:
        raise ValueError("--input-len and --output-len must be at least 1")
    if not 0 <= range_ratio < 1:
        raise ValueError("--range-ratio must be in [0, 1)")
    rng = np.random.default_rng(seed)
    maker = PromptMaker(codec, rng)
    out = []
    for _ in range(num_prompts):
        n_in = int(rng.integers(max(1, round(input_len * (1 - range_ratio))),
                                round(input_len * (1 + range_ratio)) + 1))
        n_out = int(rng.integers(max(1, round(output_len * (1 - range_ratio))),
                                 round(output_len * (1 + range_ratio)) + 1))
        text, n = maker.text(n_in)
        out.append(SampleRequest(text, n, n_out))
    return out


def shared_prefix_requests(codec: TextCodec, num_prompts: int, num_prefixes: int,
                           prefix_len: int, suffix_len: int, output_len: int,
                           seed: int = 0) -> list[SampleRequest]:
    """``num_prompts`` requests spread round-robin over ``num_prefixes`` prefixes, shuffled.

    The prefix is the same string in every request that uses it, so the server's
    tokenization of it is shared up to at most the last pre-token (BPE never merges
    across a pre-tokenizer boundary, and the suffix begins a new word).
    """
    if num_prefixes < 1 or prefix_len < 1 or suffix_len < 1 or output_len < 1:
        raise ValueError("--num-prefixes, --prefix-len, --suffix-len and --output-len "
                         "must be at least 1")
    rng = np.random.default_rng(seed)
    maker = PromptMaker(codec, rng)
    prefixes = [maker.text(prefix_len) for _ in range(num_prefixes)]
    out = []
    for i in range(num_prompts):
        k = i % num_prefixes
        prefix, _ = prefixes[k]
        suffix, _ = maker.text(suffix_len)
        text = prefix + " " + suffix.lstrip()
        out.append(SampleRequest(text, len(codec.encode(text)), output_len, prefix_id=k))
    order = rng.permutation(len(out))
    return [out[j] for j in order]


def chat_requests(codec: TextCodec, render: Callable[[list[dict[str, str]]], str],
                  num_prompts: int, num_prefixes: int, prefix_len: int, suffix_len: int,
                  output_len: int, seed: int = 0) -> list[SampleRequest]:
    """Two-turn conversations on the served model's own chat template (``render``): a
    system prompt of ``prefix_len`` tokens (``num_prefixes`` of them, round-robin), a
    user turn of ``suffix_len`` tokens, and for half of the requests the second turn:
    the first exchange, a canned assistant answer and another user turn. Each request's
    text is what the chat route would build, so the shared part is the system prompt (and
    for second turns the whole first exchange): the common case a prefix cache serves.
    Requests come in conversation order, first turns before second turns.
    """
    if num_prefixes < 1 or prefix_len < 1 or suffix_len < 1 or output_len < 1:
        raise ValueError("--num-prefixes, --prefix-len, --suffix-len and --output-len "
                         "must be at least 1")
    rng = np.random.default_rng(seed)
    maker = PromptMaker(codec, rng)
    systems = [maker.text(prefix_len)[0] for _ in range(num_prefixes)]
    conversations = (num_prompts + 1) // 2
    first: list[SampleRequest] = []
    second: list[SampleRequest] = []
    for c in range(conversations):
        k = c % num_prefixes
        turn = [{"role": "system", "content": systems[k]},
                {"role": "user", "content": maker.text(suffix_len)[0]}]
        text = render(turn)
        first.append(SampleRequest(text, len(codec.encode(text, False)), output_len, k))
        if len(first) + len(second) < num_prompts:
            turn += [{"role": "assistant", "content": maker.text(output_len)[0]},
                     {"role": "user", "content": maker.text(suffix_len)[0]}]
            text = render(turn)
            second.append(SampleRequest(text, len(codec.encode(text, False)), output_len, k))
    return first + second


def spread_adapters(requests: list[SampleRequest], spread: Sequence[str | None]
                    ) -> list[SampleRequest]:
    """Request i names ``spread[i % len(spread)]`` (None: the base), in the order sent."""
    if not spread:
        return requests
    return [replace(r, adapter=spread[i % len(spread)]) for i, r in enumerate(requests)]
