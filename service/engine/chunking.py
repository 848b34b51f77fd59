"""How many prompt tokens the next chunk of a long prefill takes.

Each chunk is a forward pass of its own (ONNX Runtime's GroupQueryAttention cannot take a
prompt chunk and the decoding rows in one call), so the running rows wait for it: their
gap between two tokens while a long prompt joins is one decode step plus one chunk. On a
CPU a chunk of 256 tokens of a GPT-2-size model costs about fifteen decode steps. The
adaptive budget sizes every chunk so that it costs about one decode step of the running
batch, measured as the engine runs (smoothed), which keeps that gap near twice the steady
one whatever the model and machine; a prompt joining an idle engine is prefilled in one
pass, since nobody waits for it. The fixed budget (``adaptive=False``) always takes
``max_tokens``.
"""

from __future__ import annotations

MIN_CHUNK_TOKENS = 16  # below this a pass is mostly fixed cost (weights read once per pass)


class ChunkBudget:
    def __init__(self, max_tokens: int, adaptive: bool = True, smoothing: float = 0.3) -> None:
        self.max_tokens = max_tokens
        self.adaptive = adaptive
        self.smoothing = smoothing
        self.decode_s: float | None = None  # a decode step of the running batch
        self.token_s: float | None = None  # one prompt token of a chunk pass

    def _smooth(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    def observe_decode(self, seconds: float) -> None:
        self.decode_s = self._smooth(self.decode_s, seconds)

    def observe_chunk(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self.token_s = self._smooth(self.token_s, seconds / tokens)

    def next_chunk(self, running: bool, left: int) -> int:
        """Tokens of the next pass for a prompt with ``left`` tokens still to prefill."""
        if not self.adaptive:
            return self.max_tokens
        if not running:
            return left
        if self.decode_s is None or self.token_s is None or self.token_s <= 0:
            return min(self.max_tokens, MIN_CHUNK_TOKENS)  # measure with a small one first
        fit = int(self.decode_s / self.token_s)
        return max(MIN_CHUNK_TOKENS, min(self.max_tokens, fit))
