"""A batch of sequences decoding together: the unit the scheduler steps (TGI's CausalLMBatch).

A row is a slot of the runner's KV pool and nothing more: the pool holds its keys,
values and cached length, so the batch keeps no cache and no padding, and each runner
lays out its own inputs. The first ``step`` prefills every row's prompt and samples its
first token; each later one feeds every row's newest token. ``filter`` drops finished
rows and ``concatenate`` merges a freshly prefilled batch into the running one (the
runner arranges the slots). A one-row batch can also be prefilled in chunks before its
first ``step``: each a pass of its own (``prefill_chunk``), or riding along with the
running batch's decode step (``step_with_chunk``). The batch chooses each row's tokens;
its sequence (service/engine/sequence.py) turns them into text, events and the finish.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from service.engine.device import SampledRows
from service.engine.kv_pool import Slot
from service.engine.request import GenerationRequest, TokenEvent, TokenInfo
from service.engine.runner import ModelRunner
from service.engine.sampling import RowSampler, choose_tokens, log_softmax, top_logprobs
from service.engine.sequence import SequenceState
from service.engine.speculative import Speculator, accept
from service.engine.text import TextCodec

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
        self.prompt_done = 0  # prompt tokens already fed by prefill_chunk (one row)

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

    def prefill_chunk(self, runner: ModelRunner, size: int) -> None:
        """Feed the next ``size`` prompt tokens of a one-row batch, sampling nothing.

        The last part of the prompt is left to ``step``, which samples the first token.
        """
        if size >= self.prompt_left:
            raise ValueError("prefill_chunk needs more than one chunk of prompt left")
        chunk = self._next_chunk(runner, size)
        runner.extend_last(self.slots[0], chunk)
        self.prompt_done += len(chunk)

    def _next_chunk(self, runner: ModelRunner, size: int) -> np.ndarray:
        """The next ``size`` (at most) prompt tokens of a one-row batch, its slot taken."""
        if len(self) != 1 or self.is_prefilled:
            raise ValueError("prompt chunks are fed to a one-row batch before its first step")
        seq = self.sequences[0]
        seq.prefill_start = seq.prefill_start or time.perf_counter()
        self.reserve(runner)
        return np.asarray(seq.request.prompt_ids[self.prompt_done:self.prompt_done + size],
                          np.int64)  # (size,)

    def step_with_chunk(self, runner: ModelRunner, partial: Batch, size: int
                        ) -> tuple[list[TokenEvent], list[TokenEvent]]:
        """One decode step of this batch with the next ``size`` prompt tokens of the
        one-row ``partial`` in the same pass (``runner.decode_with_chunk``): this batch's
        events, and the partial's first token once its whole prompt is in (else none)."""
        if self.next_tokens is None:
            raise ValueError("step_with_chunk needs a prefilled batch")
        chunk = partial._next_chunk(runner, size)
        completes = len(chunk) == partial.prompt_left
        last, chunk_last = runner.decode_with_chunk(self.slots, self.next_tokens,
                                                    partial.slots[0], chunk)
        partial.prompt_done += len(chunk)
        events = self._sample(last)  # (B, V)
        return events, partial._sample(chunk_last) if completes else []  # (1, V)

    def step_with_prompts(self, runner: ModelRunner, fresh: Batch
                          ) -> tuple[list[TokenEvent], list[TokenEvent]]:
        """One decode step of this batch with the newcomers of ``fresh`` prefilled in the
        same pass where the runner can (``runner.decode_with_prompts``): this batch's
        events, and each newcomer's first token."""
        if self.next_tokens is None or fresh.is_prefilled:
            raise ValueError("step_with_prompts needs a prefilled batch and a fresh one")
        prompts = fresh._start_prefill(runner)  # takes fresh's slots
        last, firsts = runner.decode_with_prompts(self.slots, self.next_tokens, fresh.slots,
                                                  prompts)
        events = self._sample(last)  # (B, V)
        return events, fresh._sample(np.stack([rows[-1] for rows in firsts]))  # (P, V)

    def _start_prefill(self, runner: ModelRunner) -> list[np.ndarray]:
        """Stamp the rows' prefill start, take their slots; their prompts (T_i,)."""
        start = time.perf_counter()
        for seq in self.sequences:
            seq.prefill_start = seq.prefill_start or start
        self.reserve(runner)
        return [np.asarray(s.request.prompt_ids, np.int64) for s in self.sequences]

    def release(self, runner: ModelRunner) -> None:
        """Give the rows' slots back to the runner."""
        if self.slots:
            runner.leave(self.slots, [])
            self.slots = []

    @property
    def reserved_tokens(self) -> int:
        return sum(s.request.reserved_tokens for s in self.sequences)

    @property
    def cached_tokens(self) -> int:
        return sum(s.cached_tokens for s in self.sequences)

    def step(self, runner: ModelRunner) -> list[TokenEvent]:
        """Run prefill (first call) or one decode step; one new token for every row."""
        if self.next_tokens is None:
            want_prompt = any(s.request.prompt_logprobs for s in self.sequences)
            prompts = self._start_prefill(runner)
            logits = runner.prefill(self.slots, prompts, want_prompt)  # (T_i or 1, V) each
            if want_prompt:
                self._record_prompt_logprobs(logits)
            last = np.stack([rows[-1] for rows in logits])  # (B, V)
        elif self._argmax_only():  # token ids are all the step needs from the graph
            return self._emit(runner.decode_ids(self.slots, self.next_tokens))  # (B,)
        elif runner.samples_on_device and self._plain_draws():  # drawn on the GPU
            return self._emit(runner.decode_ids(self.slots, self.next_tokens,
                                                self._sampled_rows(runner.vocab_size)))
        else:
            last = runner.decode(self.slots, self.next_tokens)  # (B, V)
        return self._sample(last)

    def _argmax_only(self) -> bool:
        """Every row takes the raw logits' argmax and reports no log-probability."""
        return all(s.sampler.params.is_plain_greedy and not s.request.token_logprobs
                   and not s.request.sampling.top_n_logprobs for s in self.sequences)

    def _plain_draws(self) -> bool:
        """Every row greedy or sampling with temperature, top-k and top-p alone, none
        reporting a log-probability: what a sampler beside the logits computes."""
        return all((s.sampler.params.is_plain_greedy or s.sampler.params.is_plain_sampling)
                   and not s.request.token_logprobs and not s.request.sampling.top_n_logprobs
                   for s in self.sequences)

    def _sampled_rows(self, vocab: int) -> SampledRows:
        """Each row's parameters and this step's draw from its own generator (one, as the
        host sampler takes); greedy rows top-k 1."""
        params = [s.sampler for s in self.sequences]
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

    def _emit(self, tokens: np.ndarray) -> list[TokenEvent]:
        """Each row's next token, chosen by the runner (``decode_ids``): ``_sample``
        without logits."""
        for seq, token in zip(self.sequences, tokens, strict=True):
            seq.sampler.observe(int(token))
        self.next_tokens = np.asarray(tokens, np.int64)  # (B,) fed at the next step
        now = time.perf_counter()
        return [self._advance(i, seq, int(tokens[i]), None, None, now)
                for i, seq in enumerate(self.sequences)]

    def _sample(self, last: np.ndarray) -> list[TokenEvent]:
        """Each row's next token from its logits ``last`` (B, V)."""
        last = np.ascontiguousarray(last, np.float32)
        tokens, logprobs = choose_tokens(last, [s.sampler for s in self.sequences],
                                         [s.request.token_logprobs for s in self.sequences])
        self.next_tokens = np.asarray(tokens, np.int64)  # (B,) fed at the next step
        now = time.perf_counter()
        return [self._advance(i, seq, int(tokens[i]), seq.reported(logprobs[i]), last, now)
                for i, seq in enumerate(self.sequences)]

    def speculate(self, runner: ModelRunner, speculator: Speculator) -> list[list[TokenEvent]]:
        """One decode step with speculation: the events of each row (one or more tokens).

        A row with a proposal feeds its newest token and the drafted ones in one pass
        (``runner.extend``), keeps what verification accepts plus the target's own next
        token, and rolls its cache back past the rest (``runner.truncate``). Rows without
        a proposal decode one token together, as in ``step``.
        """
        if self.next_tokens is None:
            raise ValueError("speculate needs a prefilled batch")
        fed = self.next_tokens
        proposals = [speculator.propose(seq.request.id,
                                        [*seq.request.prompt_ids, *seq.output_ids],
                                        seq.sampler, self._draft_room(runner, i))
                     for i, seq in enumerate(self.sequences)]
        events: list[list[TokenEvent]] = [[] for _ in self.sequences]
        next_tokens = fed.copy()
        plain = [i for i, p in enumerate(proposals) if p is None]
        if plain:
            started = time.perf_counter()
            last = np.ascontiguousarray(runner.decode([self.slots[i] for i in plain],
                                                      fed[plain]), np.float32)  # (P, V)
            speculator.observe_plain(time.perf_counter() - started)
            tokens, logprobs = choose_tokens(
                last, [self.sequences[i].sampler for i in plain],
                [self.sequences[i].request.token_logprobs for i in plain])
            now = time.perf_counter()
            for j, i in enumerate(plain):
                seq = self.sequences[i]
                events[i] = [self._advance(j, seq, int(tokens[j]), seq.reported(logprobs[j]),
                                           last, now)]
                next_tokens[i] = tokens[j]
        for i, proposal in enumerate(proposals):
            if proposal is None:
                continue
            seq, slot = self.sequences[i], self.slots[i]
            cached = runner.cached_length(slot)
            row_tokens = np.concatenate([fed[i:i + 1], proposal.tokens])  # (k + 1,)
            started = time.perf_counter()
            logits = np.ascontiguousarray(runner.extend(slot, row_tokens),
                                          np.float32)  # (k + 1, V)
            verify_seconds = time.perf_counter() - started
            verdict = accept(proposal.tokens.tolist(), logits, seq.sampler, proposal.probs,
                             seq.stop_ids)
            runner.truncate(slot, cached + 1 + verdict.accepted)  # fed token + kept drafts
            speculator.record(seq.request.id, verdict, verify_seconds)
            logprobs_all = log_softmax(logits) if seq.request.token_logprobs else None  # (k+1, V)
            now = time.perf_counter()
            for token, position in zip(verdict.tokens, verdict.positions, strict=True):
                events[i].append(self._advance(
                    position, seq, token,
                    None if logprobs_all is None else float(logprobs_all[position, token]),
                    logits, now))
                if seq.finish is not None:
                    break
            next_tokens[i] = verdict.tokens[-1]
        self.next_tokens = next_tokens
        return events

    def _draft_room(self, runner: ModelRunner, row: int) -> int:
        """Drafted tokens row ``row`` may verify: within its max_new_tokens (the last token
        of a pass is the target's own) and its slot."""
        seq = self.sequences[row]
        left = seq.request.stopping.max_new_tokens - seq.generated - 1
        room = runner.max_len - runner.cached_length(self.slots[row]) - 1
        return max(0, min(left, room))

    def _record_prompt_logprobs(self, logits: list[np.ndarray]) -> None:
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
