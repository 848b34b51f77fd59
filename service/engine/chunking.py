"""How many prompt tokens the next chunk of a long prefill takes.

The running rows wait for every chunk. Where the runner mixes them (engine_mixed.onnx:
the chunk rides in the decode step's pass, export/onnx/engine_graph.py), a chunk costs its
tokens' arithmetic on top of the step; otherwise it is a pass of its own, which reads all
the weights again (on a CPU a chunk of 256 tokens of a GPT-2-size model costs about
fifteen decode steps). The adaptive budget sizes every chunk from what the engine
measures as it runs (smoothed): a pass of its own costs about one decode step, so the
running rows' gap while a long prompt joins stays near twice the steady one; a mixed
chunk adds about half a step, so the gap stays near 1.5 times. A prompt joining an idle
engine is prefilled in one pass, since nobody waits for it. The fixed budget
(``adaptive=False``) always takes ``max_tokens``.
"""

from __future__ import annotations

from service.engine.speculative import moving_average

MIN_CHUNK_TOKENS = 16  # below this a pass is mostly fixed cost (weights read once per pass)
MIN_MIXED_CHUNK_TOKENS = 8  # a riding chunk has no such cost; fewer tokens, more steps
MIXED_SHARE = 0.5  # a mixed chunk's own cost, as a share of the decode step it rides in


class ChunkBudget:
    def __init__(self, max_tokens: int, adaptive: bool = True, smoothing: float = 0.3,
                 mixed: bool = False) -> None:
        self.max_tokens = max_tokens
        self.adaptive = adaptive
        self.smoothing = smoothing
        self.mixed = mixed  # chunks ride in the decode step's pass
        self.decode_s: float | None = None  # a decode step of the running batch
        self.token_s: float | None = None  # one prompt token of a chunk

    def observe_decode(self, seconds: float) -> None:
        self.decode_s = moving_average(self.decode_s, seconds, self.smoothing)

    def observe_chunk(self, tokens: int, seconds: float) -> None:
        """A chunk that was a pass of its own."""
        if tokens > 0:
            self.token_s = moving_average(self.token_s, seconds / tokens, self.smoothing)

    def observe_mixed(self, tokens: int, seconds: float) -> None:
        """A decode step that carried a chunk of ``tokens``: the chunk's share is what the
        step took beyond a plain decode step."""
        if tokens > 0 and self.decode_s is not None:
            extra = max(seconds - self.decode_s, 0.0)
            self.token_s = moving_average(self.token_s, extra / tokens, self.smoothing)

    def next_chunk(self, running: bool, left: int) -> int:
        """Tokens of the next pass for a prompt with ``left`` tokens still to prefill."""
        if not self.adaptive:
            return self.max_tokens
        if not running:
            return left
        least = MIN_MIXED_CHUNK_TOKENS if self.mixed else MIN_CHUNK_TOKENS
        if self.decode_s is None or self.token_s is None or self.token_s <= 0:
            return min(self.max_tokens, least)  # measure with a small one first
        fit = int(self.decode_s * (MIXED_SHARE if self.mixed else 1.0) / self.token_s)
        return max(least, min(self.max_tokens, fit))
