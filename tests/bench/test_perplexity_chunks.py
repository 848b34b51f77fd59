"""benchmarks/perplexity.py's ``--llama-perplexity`` windows against llama.cpp's own loop
(tools/perplexity/perplexity.cpp, perplexity()): chunk i feeds tokens [i·n_ctx, (i+1)·n_ctx)
and scores the logits from position first = n_ctx / 2, i.e. n_ctx - 1 - first tokens, the
tokens after position first; n_chunk = n_tokens / n_ctx; fewer than 2·n_ctx tokens refused."""

from __future__ import annotations

import pytest

from benchmarks.perplexity import llama_chunks


def _llama_scored(n_tokens: int, n_ctx: int) -> list[int]:
    """The token positions perplexity.cpp scores, from its loop."""
    first = n_ctx // 2
    scored = []
    for i in range(n_tokens // n_ctx):
        start = i * n_ctx
        scored += [start + first + 1 + j for j in range(n_ctx - 1 - first)]
    return scored


@pytest.mark.parametrize(("n_tokens", "n_ctx"), [(1024, 512), (1100, 512), (2048, 256),
                                                 (777, 128)])
def test_the_chunks_score_what_llama_perplexity_scores(n_tokens: int, n_ctx: int) -> None:
    chunks = llama_chunks(n_tokens, n_ctx)
    scored = [t for begin, end, first in chunks for t in range(first, end)]
    assert scored == _llama_scored(n_tokens, n_ctx)
    assert all(end - begin == n_ctx for begin, end, _ in chunks)  # fed whole, from 0


def test_too_few_tokens_are_refused() -> None:
    with pytest.raises(ValueError, match="needs at least 1024 tokens, got 1023"):
        llama_chunks(1023, 512)
