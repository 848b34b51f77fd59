"""A batch of sequences decoding together: the rows the scheduler steps (TGI's CausalLMBatch).

A row is a slot of the runner's KV pool and nothing more: the pool holds its keys,
values and cached length, so the batch keeps no cache and no padding, and each runner
lays out its own inputs. A batch says what each of its rows feeds a step (``work``: the
next part of its prompt until the prompt is in, then its newest token, and the drafts to
verify where the speculator proposes some, each row with what its request computes it
under: its ``ModelVariant``) and keeps each row's state as the step gives it back
(service/engine/step.py): its prompt's progress (``fed``), then its tokens (``advance``,
and ``take_verified`` for drafts); each row's sequence (service/engine/sequence.py) turns
a token into text, an event and the finish.
``filter`` drops finished rows and ``concatenate`` merges a freshly prefilled batch into
the running one (the runner arranges the slots).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np

from service.artifact.text import TextCodec
from service.engine.kv_pool import Slot
from service.engine.request import GenerationRequest, ModelVariant, TokenEvent, TokenInfo
from service.engine.runner import ModelRunner
from service.engine.sampling import RowSampler, log_softmax, top_logprobs
from service.engine.sequence import SequenceState
from service.engine.speculative import Verdict
from service.engine.step_plan import RowDraw, RowWork, Want

BELOW_ONE = np.float32(1.0) - np.float32(2.0 ** -24)  # the largest float32 below 1


class Batch:
    def __init__(self, sequences: list[SequenceState], codec: TextCodec,
                 slots: list[Slot] | None = None,
                 next_tokens: np.ndarray | None = None) -> None:
        self.sequences = sequences
        self.codec = codec
        self.slots: list[Slot] = slots or []  # row i's place in the runner's KV pool
        # (B,) each row's newest token, fed at the next step; None before prefill
        self.next_tokens = next_tokens
        self.prompt_done = [0] * len(sequences)  # each row's prompt tokens in its slot

    @classmethod
    def from_requests(cls, requests: Sequence[GenerationRequest], codec: TextCodec,
                      vocab_size: int) -> Batch:
        """A batch ready for prefill (it takes its slots then, or from ``reserve``)."""
        sequences = [SequenceState(r, RowSampler(r.sampling, vocab_size, r.prompt_ids),
                                   codec.decoder()) for r in requests]
        return cls(sequences, codec)

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def is_prefilled(self) -> bool:
        return self.next_tokens is not None

    @property
    def prompt_left(self) -> int:
        """Prompt tokens not fed yet (before the first step), over all rows."""
        if self.is_prefilled:
            return 0
        return sum(len(s.request.prompt_ids) for s in self.sequences) - sum(self.prompt_done)

    def reserve(self, runner: ModelRunner, top: bool = False) -> None:
        """Take empty slots for the rows now (``top``: away from the running rows), each
        holding its prompt's cached prefix where the prefix cache has one (not for rows
        that want their prompt's logprobs: those need every position computed)."""
        if self.slots:
            return
        prompts = None if self.is_prefilled else [
            None if s.request.prompt_logprobs else np.asarray(s.request.prompt_ids, np.int64)
            for s in self.sequences]
        self.slots = runner.reserve(len(self), top, prompts, self.variants)
        if prompts is not None:
            self.prompt_done = [runner.cached_length(s) for s in self.slots]

    def release(self, runner: ModelRunner) -> None:
        """Give the rows' slots back to the runner."""
        if self.slots:
            runner.leave(self.slots, [], self.variants)
            self.slots = []

    @property
    def variants(self) -> list[ModelVariant]:
        """What each row is computed under (its request's adapter and control vector): what
        its passes apply and what its cached prefix is keyed by."""
        return [s.request.variant for s in self.sequences]

    @property
    def reserved_tokens(self) -> int:
        return sum(s.request.reserved_tokens for s in self.sequences)

    # -- this batch's rows of a step (service/engine/step.py) --------------------------

    def work(self, runner: ModelRunner, chunk: int = 0,
             drafts: Mapping[int, np.ndarray] | None = None) -> list[RowWork]:
        """What each row feeds this step. Before the first token: the rest of its prompt,
        or at most ``chunk`` tokens of it (the rows take their slots now). After it: its
        newest token, and the drafts to verify for rows in ``drafts`` (row → (k,) ids).
        Where the decoding rows need nothing but token ids (greedy without logprobs, or
        plain draws on a runner that samples beside the logits), the runner picks them."""
        if not self.is_prefilled:
            start = time.perf_counter()
            for seq in self.sequences:
                seq.prefill_start = seq.prefill_start or start
            self.reserve(runner)
            return [RowWork(slot, np.asarray(seq.request.prompt_ids[done:done + chunk if chunk
                                                                     else None], np.int64),
                            "every" if seq.request.prompt_logprobs else "last",
                            first=not done, variant=seq.request.variant)
                    for seq, slot, done in zip(self.sequences, self.slots, self.prompt_done,
                                               strict=True)]
        tokens = self.next_tokens
        assert tokens is not None
        drafts = drafts or {}
        plain = [i for i in range(len(self)) if i not in drafts]
        want, draws = self._decode_want(runner, plain)
        rows = []
        for i, (slot, variant) in enumerate(zip(self.slots, self.variants, strict=True)):
            if i in drafts:
                rows.append(RowWork(slot, np.concatenate([tokens[i:i + 1], drafts[i]]),
                                    "every", drafted=True, variant=variant))  # (k + 1,)
            else:
                rows.append(RowWork(slot, tokens[i:i + 1], want, draws.get(i),
                                    variant=variant))
        return rows

    def _decode_want(self, runner: ModelRunner, rows: Sequence[int]
                     ) -> tuple[Want, dict[int, RowDraw]]:
        """What the decoding ``rows`` want back, and each one's draw where the runner
        samples: one choice for them all, so the runner's pass returns one kind."""
        seqs = [self.sequences[i] for i in rows]
        if _argmax_only(seqs):
            return "argmax", {}
        if runner.samples_on_device and _plain_draws(seqs):
            return "draw", {i: _row_draw(self.sequences[i], runner.vocab_size) for i in rows}
        return "last", {}

    def completes(self, row: int, work: RowWork) -> bool:
        """Whether row ``row`` takes a token after feeding ``work``: a decoding row, or
        one whose prompt it ends."""
        return self.is_prefilled or self.prompt_done[row] + len(work.tokens) == len(
            self.sequences[row].request.prompt_ids)

    def fed(self, row: int, work: RowWork, output: np.ndarray) -> None:
        """Row ``row`` fed ``work``, of which the runner returned ``output``: the next part
        of its prompt is in, with the prompt's logprobs where the request asks for them
        (such a prompt is fed whole: never chunked, nothing reused). A decoding row's
        state changes with its token alone."""
        if self.is_prefilled:
            return
        self.prompt_done[row] += len(work.tokens)
        if self.sequences[row].request.prompt_logprobs:
            self._record_prompt_logprobs(self.sequences[row], output)

    # -- a row's tokens ----------------------------------------------------------------

    def advance(self, row: int, token: int, logprob: float | None,
                logits: np.ndarray | None, now: float) -> TokenEvent:
        """Row ``row`` takes ``token``, which it feeds at the next step; its top logprobs
        from its ``logits`` (V,) where the request asks for them."""
        seq = self.sequences[row]
        top: tuple[tuple[int, str, float], ...] = ()
        n = seq.request.sampling.top_n_logprobs
        if n and logits is not None:
            top = tuple((t, self.codec.token_text(t), lp) for t, lp in top_logprobs(logits, n))
        if self.next_tokens is None:  # (B,) its first tokens
            self.next_tokens = np.zeros(len(self), np.int64)
        self.next_tokens[row] = token
        return seq.advance(token, logprob, top, self.codec, now)

    def take_verified(self, row: int, verdict: Verdict, logits: np.ndarray
                      ) -> list[TokenEvent]:
        """Row ``row`` takes what verification kept, judged on its logits (k + 1, V)."""
        seq = self.sequences[row]
        logprobs = log_softmax(logits) if seq.request.token_logprobs else None  # (k+1, V)
        now = time.perf_counter()
        events = []
        for token, position in zip(verdict.tokens, verdict.positions, strict=True):
            events.append(self.advance(
                row, token, None if logprobs is None else float(logprobs[position, token]),
                logits[position], now))
            if seq.finish is not None:
                break
        return events

    def draft_room(self, runner: ModelRunner, row: int) -> int:
        """Drafted tokens row ``row`` may verify: within its max_new_tokens (the last token
        of a pass is the target's own) and its slot."""
        seq = self.sequences[row]
        left = seq.request.stopping.max_new_tokens - seq.generated - 1
        room = runner.max_len - runner.cached_length(self.slots[row]) - 1
        return max(0, min(left, room))

    def _record_prompt_logprobs(self, seq: SequenceState, rows: np.ndarray) -> None:
        """Each prompt token's logprob given the tokens before it (``rows``: the prompt's
        logits, (n, V)), and the request's top-n alternatives at that position (OpenAI's
        echo with logprobs; vLLM's prompt_logprobs)."""
        ids = seq.request.prompt_ids
        lp = log_softmax(rows[:-1])  # (n - 1, V): predicts tokens 1..n-1
        best = _best_ids(lp, seq.request.sampling.top_n_logprobs)  # (n - 1, k)
        text = self.codec.token_text
        infos = [TokenInfo(ids[0], text(ids[0]), None)]
        infos += [TokenInfo(t, text(t), float(lp[j, t]),
                            top=tuple((int(b), text(int(b)), float(lp[j, b]))
                                      for b in best[j]))
                  for j, t in enumerate(ids[1:])]
        seq.prefill = tuple(infos)

    def filter(self, keep: Sequence[int], runner: ModelRunner) -> None:
        """Keep only the rows ``keep``; the others' slots go back to the runner."""
        if len(keep) == len(self):
            return
        if self.next_tokens is None or not keep:
            raise ValueError("filter needs a prefilled batch and at least one row to keep")
        self.slots = runner.leave(self.slots, keep, self.variants)
        self.next_tokens = self.next_tokens[np.asarray(keep, dtype=np.int64)]
        self.sequences = [self.sequences[i] for i in keep]

    @classmethod
    def concatenate(cls, batches: Sequence[Batch], runner: ModelRunner) -> Batch:
        """One batch of all rows (prefilled batches only); the runner arranges the slots."""
        if len(batches) == 1:
            return batches[0]
        tokens = [b.next_tokens for b in batches]
        if any(t is None for t in tokens):
            raise ValueError("only prefilled batches can be concatenated")
        return cls(sequences=[s for b in batches for s in b.sequences], codec=batches[0].codec,
                   slots=runner.join([b.slots for b in batches]),
                   next_tokens=np.concatenate([t for t in tokens if t is not None]))


def _best_ids(lp: np.ndarray, n: int, block: int = 256) -> np.ndarray:
    """(T, k) the ids of each row's k = min(n, V) largest log-probabilities, best first (as
    ``top_logprobs`` orders one row); ``block`` rows at a time, so a long prompt's
    selection holds (block, V) indices, not (T, V)."""
    n = min(n, lp.shape[1])
    out = np.zeros((lp.shape[0], n), np.int64)
    if n == 0:
        return out
    for lo in range(0, lp.shape[0], block):
        rows = lp[lo:lo + block]  # (b, V)
        best = np.argpartition(-rows, n - 1, axis=1)[:, :n]  # (b, k), unordered
        order = np.argsort(-np.take_along_axis(rows, best, axis=1), axis=1, kind="stable")
        out[lo:lo + block] = np.take_along_axis(best, order, axis=1)
    return out


def _argmax_only(seqs: Sequence[SequenceState]) -> bool:
    """Every row takes the raw logits' argmax and reports no log-probability."""
    return all(s.sampler.params.is_plain_greedy and not s.request.token_logprobs
               and not s.request.sampling.top_n_logprobs for s in seqs)


def _plain_draws(seqs: Sequence[SequenceState]) -> bool:
    """Every row greedy or sampling with temperature, top-k and top-p alone, none
    reporting a log-probability: what a sampler beside the logits computes."""
    return all((s.sampler.params.is_plain_greedy or s.sampler.params.is_plain_sampling)
               and not s.request.token_logprobs and not s.request.sampling.top_n_logprobs
               for s in seqs)


def _row_draw(seq: SequenceState, vocab: int) -> RowDraw:
    """The row's parameters and this step's draw from its own generator (one, as the
    host sampler takes); a greedy row top-k 1."""
    sampler = seq.sampler
    params = sampler.params
    if not params.do_sample:
        return RowDraw(temperature=1.0, top_k=1, top_p=2.0, u=0.0)
    u = sampler.rng.random() if sampler.rng is not None else 0.0
    return RowDraw(temperature=params.temperature, top_k=params.top_k or vocab,
                   top_p=params.top_p if params.top_p < 1.0 else 2.0,
                   u=float(min(np.float32(u), BELOW_ONE)))  # [0, 1) in float32 too
