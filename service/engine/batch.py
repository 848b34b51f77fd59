"""A batch of sequences decoding together: the rows the scheduler steps (TGI's CausalLMBatch).

A row is a slot of the runner's KV pool and nothing more: the pool holds its keys,
values and cached length, so the batch keeps no cache and no padding, and each runner
lays out its own inputs. A batch states its part of a step's plan (``prompt_work`` for a
fresh batch's prompts, ``chunk_work`` for the next chunk of a long one, ``decode_work``
for the running rows' newest tokens; service/engine/step.py assembles them) and chooses
its rows' tokens from what the runner returned (``take_*``); each row's sequence
(service/engine/sequence.py) turns a token into text, an event and the finish.
``filter`` drops finished rows and ``concatenate`` merges a freshly prefilled batch into
the running one (the runner arranges the slots).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from service.artifact.text import TextCodec
from service.engine.device import SampledRows
from service.engine.kv_pool import Slot
from service.engine.request import GenerationRequest, TokenEvent, TokenInfo
from service.engine.runner import ModelRunner
from service.engine.sampling import RowSampler, choose_tokens, log_softmax, top_logprobs
from service.engine.sequence import SequenceState
from service.engine.speculative import Verdict
from service.engine.step_plan import ChunkWork, DecodeWork, PromptWork

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
        self.prompt_done = 0  # prompt tokens already fed in chunks (one row)

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
        return sum(len(s.request.prompt_ids) for s in self.sequences) - self.prompt_done

    def reserve(self, runner: ModelRunner, top: bool = False) -> None:
        """Take empty slots for the rows now (``top``: away from the running rows)."""
        if not self.slots:
            self.slots = runner.reserve(len(self), top)

    def release(self, runner: ModelRunner) -> None:
        """Give the rows' slots back to the runner."""
        if self.slots:
            runner.leave(self.slots, [])
            self.slots = []

    @property
    def reserved_tokens(self) -> int:
        return sum(s.request.reserved_tokens for s in self.sequences)

    # -- this batch's part of a step's plan (service/engine/step.py) ------------------

    def decode_work(self, runner: ModelRunner, rows: Sequence[int] | None = None
                    ) -> DecodeWork:
        """Rows ``rows`` (default: all) feed their newest token. Where those rows need
        nothing but token ids (greedy without logprobs, or plain draws on a runner that
        samples beside the logits), the runner picks the tokens itself."""
        if self.next_tokens is None:
            raise ValueError("decoding needs a prefilled batch")
        seqs = self.sequences if rows is None else [self.sequences[i] for i in rows]
        slots = self.slots if rows is None else [self.slots[i] for i in rows]
        tokens = self.next_tokens if rows is None else self.next_tokens[list(rows)]  # (R,)
        if _argmax_only(seqs):
            return DecodeWork(slots, tokens, "argmax")
        if runner.samples_on_device and _plain_draws(seqs):
            return DecodeWork(slots, tokens, "sampled", _sampled_rows(seqs, runner.vocab_size))
        return DecodeWork(slots, tokens)

    def prompt_work(self, runner: ModelRunner) -> PromptWork:
        """Every row's whole prompt (a fresh batch): the rows take their slots now."""
        if self.is_prefilled:
            raise ValueError("the prompts of a prefilled batch are in already")
        start = time.perf_counter()
        for seq in self.sequences:
            seq.prefill_start = seq.prefill_start or start
        self.reserve(runner)
        return PromptWork(self.slots,
                          [np.asarray(s.request.prompt_ids, np.int64) for s in self.sequences],
                          any(s.request.prompt_logprobs for s in self.sequences))

    def chunk_work(self, runner: ModelRunner, size: int) -> ChunkWork:
        """The next ``size`` (at most) prompt tokens of a one-row batch before its first
        token; the row takes its slot now if it has none."""
        if len(self) != 1 or self.is_prefilled:
            raise ValueError("prompt chunks are fed to a one-row batch before its first token")
        seq = self.sequences[0]
        seq.prefill_start = seq.prefill_start or time.perf_counter()
        self.reserve(runner)
        return ChunkWork(self.slots[0], np.asarray(
            seq.request.prompt_ids[self.prompt_done:self.prompt_done + size], np.int64))

    # -- choosing tokens from a step's result ------------------------------------------

    def take_ids(self, tokens: np.ndarray, rows: Sequence[int] | None = None
                 ) -> list[TokenEvent]:
        """Rows ``rows`` (default: all) take the tokens (R,) the runner chose."""
        rows = range(len(self)) if rows is None else rows
        now = time.perf_counter()
        events = []
        for j, i in enumerate(rows):
            seq, token = self.sequences[i], int(tokens[j])
            seq.sampler.observe(token)
            events.append(self._advance(j, seq, token, None, None, now))
        self._set_next(tokens, rows)
        return events

    def take_logits(self, last: np.ndarray, rows: Sequence[int] | None = None
                    ) -> list[TokenEvent]:
        """Rows ``rows`` (default: all) choose their next token from their logits (R, V)."""
        rows = range(len(self)) if rows is None else rows
        seqs = [self.sequences[i] for i in rows]
        last = np.ascontiguousarray(last, np.float32)
        tokens, logprobs = choose_tokens(last, [s.sampler for s in seqs],
                                         [s.request.token_logprobs for s in seqs])
        now = time.perf_counter()
        events = [self._advance(j, seq, int(tokens[j]), seq.reported(logprobs[j]), last, now)
                  for j, seq in enumerate(seqs)]
        self._set_next(tokens, rows)
        return events

    def take_prompt_logits(self, logits: Sequence[np.ndarray]) -> list[TokenEvent]:
        """A fresh batch's first tokens from its prompts' logits, (T_i or 1, V) per row;
        the prompt logprobs of the rows that asked for them."""
        if any(s.request.prompt_logprobs for s in self.sequences):
            self._record_prompt_logprobs(logits)
        return self.take_logits(np.stack([rows[-1] for rows in logits]))  # (B, V)

    def take_verified(self, row: int, verdict: Verdict, logits: np.ndarray
                      ) -> list[TokenEvent]:
        """Row ``row`` takes what verification kept, judged on its logits (k + 1, V)."""
        seq = self.sequences[row]
        logprobs = log_softmax(logits) if seq.request.token_logprobs else None  # (k+1, V)
        now = time.perf_counter()
        events = []
        for token, position in zip(verdict.tokens, verdict.positions, strict=True):
            events.append(self._advance(
                position, seq, token,
                None if logprobs is None else float(logprobs[position, token]), logits, now))
            if seq.finish is not None:
                break
        assert self.next_tokens is not None
        self.next_tokens[row] = verdict.tokens[-1]
        return events

    def draft_room(self, runner: ModelRunner, row: int) -> int:
        """Drafted tokens row ``row`` may verify: within its max_new_tokens (the last token
        of a pass is the target's own) and its slot."""
        seq = self.sequences[row]
        left = seq.request.stopping.max_new_tokens - seq.generated - 1
        room = runner.max_len - runner.cached_length(self.slots[row]) - 1
        return max(0, min(left, room))

    def _set_next(self, tokens: np.ndarray, rows: Sequence[int]) -> None:
        """The tokens rows ``rows`` feed at the next step."""
        if self.next_tokens is None or len(rows) == len(self):
            self.next_tokens = np.asarray(tokens, np.int64)  # (B,)
        else:
            self.next_tokens[list(rows)] = tokens

    def _record_prompt_logprobs(self, logits: Sequence[np.ndarray]) -> None:
        for seq, rows in zip(self.sequences, logits, strict=True):
            if not seq.request.prompt_logprobs:
                continue
            ids = seq.request.prompt_ids
            lp = log_softmax(rows[:-1])  # (n - 1, V): predicts tokens 1..n-1
            infos = [TokenInfo(ids[0], self.codec.token_text(ids[0]), None)]
            infos += [TokenInfo(t, self.codec.token_text(t), float(lp[j, t]))
                      for j, t in enumerate(ids[1:])]
            seq.prefill = tuple(infos)

    def _advance(self, row: int, seq: SequenceState, token: int, logprob: float | None,
                 logits: np.ndarray | None, now: float) -> TokenEvent:
        """Row ``row``'s sequence takes ``token``; its top logprobs from ``logits`` (B, V)
        where the request asks for them."""
        top: tuple[tuple[int, str, float], ...] = ()
        n = seq.request.sampling.top_n_logprobs
        if n and logits is not None:
            top = tuple((t, self.codec.token_text(t), lp) for t, lp in top_logprobs(logits[row], n))
        return seq.advance(token, logprob, top, self.codec, now)

    def filter(self, keep: Sequence[int], runner: ModelRunner) -> None:
        """Keep only the rows ``keep``; the others' slots go back to the runner."""
        if len(keep) == len(self):
            return
        if self.next_tokens is None or not keep:
            raise ValueError("filter needs a prefilled batch and at least one row to keep")
        self.slots = runner.leave(self.slots, keep)
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


def _sampled_rows(seqs: Sequence[SequenceState], vocab: int) -> SampledRows:
    """Each row's parameters and this step's draw from its own generator (one, as the
    host sampler takes); greedy rows top-k 1."""
    params = [s.sampler for s in seqs]
    sampling = [p.params.do_sample for p in params]
    return SampledRows(
        temperature=np.array([p.params.temperature if d else 1.0
                              for p, d in zip(params, sampling, strict=True)], np.float32),
        top_k=np.array([(p.params.top_k or vocab) if d else 1
                        for p, d in zip(params, sampling, strict=True)], np.int64),
        top_p=np.array([p.params.top_p if d and p.params.top_p < 1.0 else 2.0
                        for p, d in zip(params, sampling, strict=True)], np.float32),
        u=np.minimum(np.array([p.rng.random() if d and p.rng is not None else 0.0
                               for p, d in zip(params, sampling, strict=True)],
                              np.float32), BELOW_ONE))  # [0, 1) in float32 too
