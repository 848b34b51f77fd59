"""Draft-model speculation: a smaller model with the target's tokenizer proposes k tokens.

The draft runs on its own runner and KV pool (one slot per speculating sequence). For
each proposal it first catches up on the tokens the target produced since the last one
(the kept drafts are already in its cache; the corrected or bonus token is not), then
decodes k tokens one at a time. What it drafted past the kept prefix is cut off at the next
proposal, so its cache always holds a prefix of the sequence. Greedy rows draft the
argmax; sampling rows draw from the draft's own distribution under the request's
temperature/top-k/top-p (no penalties), which is the q the verification rule needs
(service/engine/speculative.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from service.engine.kv_pool import Slot
from service.engine.request import SamplingParams
from service.engine.runner import ModelRunner
from service.engine.sampling import draw, warp
from service.engine.speculative import Proposal
from service.engine.step_plan import RowWork, StepPlan


@dataclass
class _DraftRow:
    slot: Slot
    cached: list[int] = field(default_factory=list)  # token ids in the draft's cache, in order
    rng: np.random.Generator | None = None


class DraftModel:
    """Drafts for the target's sequences, keyed by request id."""

    def __init__(self, runner: ModelRunner, num_tokens: int, max_len: int) -> None:
        self.runner = runner
        self.k = num_tokens
        self.max_len = max_len  # tokens one draft slot holds
        self._rows: dict[int, _DraftRow] = {}

    def propose(self, key: int, history: Sequence[int], params: SamplingParams,
                seed: int | None) -> Proposal:
        """k drafted tokens to follow ``history`` (prompt + generated, the newest sampled
        token last), or an empty proposal when the draft's pool or context is full."""
        row = self._rows.get(key)
        if row is None:
            if self.runner.rows_used >= self.runner.capacity:
                return _EMPTY
            row = self._rows[key] = _DraftRow(self.runner.reserve(1)[0], rng=(
                np.random.default_rng([seed or 0, 1]) if params.do_sample else None))
        if len(history) + self.k > self.max_len:
            return _EMPTY
        keep = _common_prefix(row.cached, history)
        if keep == len(history):  # never feed nothing: recompute the last token
            keep -= 1
        if keep < len(row.cached):
            self.runner.truncate(row.slot, keep)
            del row.cached[keep:]
        feed = np.asarray(history[keep:], np.int64)  # (T,) what the draft has not seen
        logits = self.runner.run(StepPlan((RowWork(row.slot, feed, first=not keep),))
                                 ).outputs[0][0]  # (V,)
        row.cached.extend(int(t) for t in feed)
        tokens, probs = [], []
        for i in range(self.k):
            token, q = self._pick(logits, params, row.rng)
            tokens.append(token)
            probs.append(q)
            if i + 1 < self.k:
                fed_one = RowWork(row.slot, np.asarray([token], np.int64))
                logits = self.runner.run(StepPlan((fed_one,))).outputs[0][0]  # (V,)
                row.cached.append(token)
        return Proposal(np.asarray(tokens, np.int64),
                        None if row.rng is None else np.stack(probs))  # (k, V)

    @staticmethod
    def _pick(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None
              ) -> tuple[int, np.ndarray]:
        if rng is None:
            return int(np.argmax(logits)), logits[:0]
        q = warp(logits.astype(np.float64), params)  # (V,)
        return draw(q, rng), q

    def release(self, key: int) -> None:
        """The sequence left the batch: give its draft slot back."""
        row = self._rows.pop(key, None)
        if row is not None:
            self.runner.leave([row.slot], [])

    @property
    def rows(self) -> int:
        return len(self._rows)


_EMPTY = Proposal(np.zeros(0, np.int64), None)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
