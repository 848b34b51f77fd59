"""A batch of sequences decoding together: the unit the scheduler steps (TGI's CausalLMBatch).

Rows are left-padded, so every row's newest token sits in the last column and one decode
step feeds a (B, 1) column of tokens. ``attention_mask`` marks real tokens, and
``position_ids`` count each row's own tokens, so padding changes nothing a row computes.
The KV cache stays in whatever form the runner returns from step to step (OrtValues for
model.onnx, pool slots for engine.onnx); the runner decides what a change of composition
costs: ``filter`` drops finished rows and trims columns of padding no row needs any more,
and ``concatenate`` merges a freshly prefilled batch into the running one. A one-row
batch can also be prefilled in chunks (``prefill_chunk``) before its first ``step``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from service.engine.request import (
    FinishInfo,
    FinishReason,
    GenerationRequest,
    TokenEvent,
    TokenInfo,
)
from service.engine.sampling import RowSampler, choose_tokens, log_softmax, top_logprobs
from service.engine.stats import KVStats
from service.engine.text import IncrementalDecoder, TextCodec


class ModelRunner(Protocol):
    """What a batch needs from a model: one forward pass by the ONNX I/O contract."""

    vocab_size: int

    def forward(
        self,
        input_ids: np.ndarray,  # (B, T) int64
        attention_mask: np.ndarray,  # (B, T_past + T) int64
        position_ids: np.ndarray,  # (B, T) int64
        past: Any,  # the runner's cache from the last call, or None for new rows
        all_logits: bool,
    ) -> tuple[np.ndarray, Any]:
        """Logits (B, T, V) if all_logits else (B, 1, V) for the last position, and the cache."""
        ...

    def kv_filter(self, kv: Any, rows: Sequence[int], trim: int) -> Any:
        """The cache of rows ``rows`` only (None if none), minus ``trim`` padding columns."""
        ...

    def kv_concat(self, kvs: Sequence[Any], widths: Sequence[int], width: int) -> Any:
        """One cache of all rows; batch j's mask is ``widths[j]`` wide, the result ``width``."""
        ...

    def kv_stats(self, kv: Any) -> KVStats: ...


@dataclass
class SequenceState:
    """One request inside a batch: its sampler, detokenizer, counters and timings."""

    request: GenerationRequest
    sampler: RowSampler
    decoder: IncrementalDecoder
    generated: int = 0
    prefill_start: float = 0.0
    first_token_time: float | None = None
    last_token_time: float = 0.0
    inter_token_latencies: list[float] = field(default_factory=list)
    prefill: tuple[TokenInfo, ...] = ()
    finish: FinishInfo | None = None

    @property
    def cached_tokens(self) -> int:
        """Tokens of this row in the KV cache (the newest sampled one is not fed yet)."""
        return len(self.request.prompt_ids) + max(self.generated - 1, 0)


class Batch:
    def __init__(
        self,
        sequences: list[SequenceState],
        codec: TextCodec,
        input_ids: np.ndarray,  # (B, T) prompts before prefill; (B, 1) next tokens after
        attention_mask: np.ndarray,  # (B, T) before prefill; (B, L) of the cache after
        position_ids: np.ndarray,  # (B, T) before prefill; (B, 1) after
        kv: list[Any] | None = None,
    ) -> None:
        self.sequences = sequences
        self.codec = codec
        self.input_ids = input_ids
        self.attention_mask = attention_mask
        self.position_ids = position_ids
        self.kv = kv
        self.prompt_done = 0  # prompt columns already fed by prefill_chunk
        self._prefilled = kv is not None

    @classmethod
    def from_requests(
        cls, requests: Sequence[GenerationRequest], codec: TextCodec, vocab_size: int,
        pad_token_id: int,
    ) -> Batch:
        """A batch ready for prefill: prompts left-padded to the longest one."""
        width = max(len(r.prompt_ids) for r in requests)
        input_ids = np.full((len(requests), width), pad_token_id, dtype=np.int64)  # (B, T)
        mask = np.zeros((len(requests), width), dtype=np.int64)  # (B, T)
        for i, r in enumerate(requests):
            input_ids[i, width - len(r.prompt_ids):] = r.prompt_ids
            mask[i, width - len(r.prompt_ids):] = 1
        position_ids = np.clip(mask.cumsum(axis=1) - 1, 0, None)  # (B, T)
        sequences = [SequenceState(r, RowSampler(r.sampling, vocab_size, r.prompt_ids),
                                   codec.decoder()) for r in requests]
        return cls(sequences, codec, input_ids, mask, position_ids)

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def is_prefilled(self) -> bool:
        return self._prefilled

    @property
    def prompt_left(self) -> int:
        """Prompt columns not fed yet (before the first step)."""
        return 0 if self._prefilled else self.input_ids.shape[1] - self.prompt_done

    def prefill_chunk(self, runner: ModelRunner, size: int) -> None:
        """Feed the next ``size`` prompt tokens of a one-row batch, sampling nothing.

        The last part of the prompt is left to ``step``, which samples the first token.
        """
        if len(self) != 1 or self._prefilled or size >= self.prompt_left:
            raise ValueError("prefill_chunk needs a one-row batch with more than one chunk "
                             "of prompt left")
        self.sequences[0].prefill_start = self.sequences[0].prefill_start or time.perf_counter()
        end = self.prompt_done + size
        _, self.kv = runner.forward(self.input_ids[:, self.prompt_done:end],
                                    self.attention_mask[:, :end],
                                    self.position_ids[:, self.prompt_done:end], self.kv, False)
        self.prompt_done = end

    def release(self, runner: ModelRunner) -> None:
        """Give the batch's cache back to the runner (its pool slots, if it has any)."""
        if self.kv is not None:
            runner.kv_filter(self.kv, [], 0)
            self.kv = None

    @property
    def reserved_tokens(self) -> int:
        return sum(s.request.reserved_tokens for s in self.sequences)

    @property
    def cached_tokens(self) -> int:
        return sum(s.cached_tokens for s in self.sequences)

    def step(self, runner: ModelRunner) -> list[TokenEvent]:
        """Run prefill (first call) or one decode step; one new token for every row."""
        start = time.perf_counter()
        if not self._prefilled:
            done = self.prompt_done
            for seq in self.sequences:
                seq.prefill_start = seq.prefill_start or start
            want_prompt = any(s.request.prompt_logprobs for s in self.sequences) and not done
            logits, self.kv = runner.forward(self.input_ids[:, done:], self.attention_mask,
                                             self.position_ids[:, done:], self.kv, want_prompt)
            self._prefilled = True
            if want_prompt:
                self._record_prompt_logprobs(logits)
            self.position_ids = self.attention_mask.sum(axis=1, keepdims=True)  # (B, 1)
        else:
            ones = np.ones((len(self), 1), dtype=np.int64)
            mask = np.concatenate([self.attention_mask, ones], axis=1)  # (B, L + 1)
            logits, self.kv = runner.forward(self.input_ids, mask, self.position_ids,
                                             self.kv, False)
            self.attention_mask = mask
            self.position_ids = self.position_ids + 1  # (B, 1)
        last = np.ascontiguousarray(logits[:, -1, :])  # (B, V)
        tokens, logprobs = choose_tokens(last, [s.sampler for s in self.sequences])
        self.input_ids = tokens[:, None]  # (B, 1) fed at the next step
        now = time.perf_counter()
        return [self._advance(i, seq, int(tokens[i]), float(logprobs[i]), last, now)
                for i, seq in enumerate(self.sequences)]

    def _record_prompt_logprobs(self, logits: np.ndarray) -> None:
        width = self.input_ids.shape[1]
        for i, seq in enumerate(self.sequences):
            if not seq.request.prompt_logprobs:
                continue
            ids = seq.request.prompt_ids
            pad = width - len(ids)
            lp = log_softmax(logits[i, pad:width - 1])  # (n - 1, V): predicts tokens 1..n-1
            infos = [TokenInfo(ids[0], self.codec.token_text(ids[0]), None)]
            infos += [TokenInfo(t, self.codec.token_text(t), float(lp[j, t]))
                      for j, t in enumerate(ids[1:])]
            seq.prefill = tuple(infos)

    def _advance(self, row: int, seq: SequenceState, token: int, logprob: float,
                 logits: np.ndarray, now: float) -> TokenEvent:
        req = seq.request
        if seq.first_token_time is None:
            seq.first_token_time = now
        else:
            seq.inter_token_latencies.append(now - seq.last_token_time)
        seq.last_token_time = now
        seq.generated += 1
        special = token in self.codec.special_ids
        text = self.codec.token_text(token) if special else seq.decoder.push(token)

        reason: FinishReason | None = None
        stop, stop_offset = None, None
        if req.stopping.eos_token_id is not None and (
                token == req.stopping.eos_token_id or token in req.stopping.extra_eos_ids):
            reason = "eos_token"
        elif token in req.stopping.stop_token_ids:  # vLLM: left out of the text
            reason = "stop_sequence"
            stop_offset = len(seq.decoder.text) - (0 if special else len(text))
        else:
            if seq.generated >= req.stopping.min_tokens:
                stop, stop_offset = self._match_stop(seq, len(text))
            if stop is not None:
                reason = "stop_sequence"
            elif seq.generated >= req.stopping.max_new_tokens:
                reason = "length"
        top: tuple[tuple[int, str, float], ...] = ()
        if req.sampling.top_n_logprobs:
            top = tuple((t, self.codec.token_text(t), lp)
                        for t, lp in top_logprobs(logits[row], req.sampling.top_n_logprobs))
        if reason is not None:
            if not special:
                text += seq.decoder.flush()
            generated_text = seq.decoder.text
            if stop is not None and stop_offset is not None:
                generated_text = generated_text[:stop_offset + len(stop)]
            seq.finish = FinishInfo(
                reason=reason, generated_text=generated_text, generated_tokens=seq.generated,
                seed=seq.sampler.seed, stop_sequence=stop, stop_offset=stop_offset,
                prefill=seq.prefill, queue_time=seq.prefill_start - req.arrival,
                inference_time=now - seq.prefill_start)
        info = TokenInfo(token, text, logprob, special, top)
        return TokenEvent(info, seq.generated - 1, seq.finish)

    @staticmethod
    def _match_stop(seq: SequenceState, new_chars: int) -> tuple[str | None, int | None]:
        text = seq.decoder.text
        for stop in seq.request.stopping.stop_sequences:
            at = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
            if at >= 0:
                return stop, at
        return None, None

    def filter(self, keep: Sequence[int], runner: ModelRunner) -> None:
        """Keep only the rows ``keep``; drop the padding columns no kept row still needs."""
        if len(keep) == len(self):
            return
        if self.kv is None or not keep:
            raise ValueError("filter needs a prefilled batch and at least one row to keep")
        rows = np.asarray(keep, dtype=np.int64)
        mask = self.attention_mask[rows]  # (B', L)
        trim = int((mask.shape[1] - mask.sum(axis=1)).min())  # padding columns all rows share
        self.kv = runner.kv_filter(self.kv, keep, trim)
        self.attention_mask = np.ascontiguousarray(mask[:, trim:])  # (B', L - trim)
        self.input_ids = self.input_ids[rows]
        self.position_ids = self.position_ids[rows]
        self.sequences = [self.sequences[i] for i in keep]

    @classmethod
    def concatenate(cls, batches: Sequence[Batch], runner: ModelRunner) -> Batch:
        """One batch of all rows, each left-padded to the longest cache (one copy)."""
        if len(batches) == 1:
            return batches[0]
        width = max(b.attention_mask.shape[1] for b in batches)
        total = sum(len(b) for b in batches)
        mask = np.zeros((total, width), dtype=np.int64)  # (B, L)
        start = 0
        for b in batches:
            end, w = start + len(b), b.attention_mask.shape[1]
            mask[start:end, width - w:] = b.attention_mask
            start = end
        kv = runner.kv_concat([b.kv for b in batches],
                              [b.attention_mask.shape[1] for b in batches], width)
        return cls(
            sequences=[s for b in batches for s in b.sequences], codec=batches[0].codec,
            input_ids=np.concatenate([b.input_ids for b in batches]),
            attention_mask=mask,
            position_ids=np.concatenate([b.position_ids for b in batches]),
            kv=kv)
