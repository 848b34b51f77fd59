"""One request's output inside a batch: its sampler and detokenizer, its counters and
timings, and the rules that end it (end of sequence, stop ids, stop sequences, length).

The batch chooses the tokens (service/engine/batch.py); a sequence turns each into the
event the request's stream gets: the text it adds (held until it decodes whole, see
service/artifact/text.py), and, on the last, the finish.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from service.artifact.text import IncrementalDecoder, TextCodec
from service.engine.request import (
    FinishInfo,
    FinishReason,
    GenerationRequest,
    TokenEvent,
    TokenInfo,
)
from service.engine.sampling import RowSampler


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
    output_ids: list[int] = field(default_factory=list)  # generated so far (speculation's history)

    @property
    def stop_ids(self) -> frozenset[int]:
        """Tokens that end the sequence: speculation's verification keeps nothing after one."""
        stop = self.request.stopping
        ends = set(stop.stop_token_ids)
        if stop.eos_token_id is not None:
            ends |= {stop.eos_token_id, *stop.extra_eos_ids}
        return frozenset(ends)

    def reported(self, logprob: float) -> float | None:
        """The token's logprob where the request reports one (choose_tokens skips the rest)."""
        return float(logprob) if self.request.token_logprobs else None

    def advance(self, token: int, logprob: float | None,
                top: tuple[tuple[int, str, float], ...], codec: TextCodec,
                now: float) -> TokenEvent:
        """The sequence takes ``token``: its text piece, timings, and the finish where a
        rule ends it (``top``: the top logprobs the request asked for)."""
        req = self.request
        if self.first_token_time is None:
            self.first_token_time = now
        else:
            self.inter_token_latencies.append(now - self.last_token_time)
        self.last_token_time = now
        self.generated += 1
        self.output_ids.append(token)
        special = token in codec.special_ids
        text = codec.token_text(token) if special else self.decoder.push(token)

        reason: FinishReason | None = None
        stop, stop_offset = None, None
        if req.stopping.eos_token_id is not None and (
                token == req.stopping.eos_token_id or token in req.stopping.extra_eos_ids):
            reason = "eos_token"
        elif token in req.stopping.stop_token_ids:  # vLLM: left out of the text
            reason = "stop_sequence"
            stop_offset = len(self.decoder.text) - (0 if special else len(text))
        else:
            if self.generated >= req.stopping.min_tokens:
                stop, stop_offset = self._match_stop(len(text))
            if stop is not None:
                reason = "stop_sequence"
            elif self.generated >= req.stopping.max_new_tokens:
                reason = "length"
        if reason is not None:
            if not special:
                text += self.decoder.flush()
            generated_text = self.decoder.text
            if stop is not None and stop_offset is not None:
                generated_text = generated_text[:stop_offset + len(stop)]
            self.finish = FinishInfo(
                reason=reason, generated_text=generated_text, generated_tokens=self.generated,
                seed=self.sampler.seed, stop_sequence=stop, stop_offset=stop_offset,
                prefill=self.prefill, queue_time=self.prefill_start - req.arrival,
                inference_time=now - self.prefill_start)
        info = TokenInfo(token, text, logprob, special, top)
        return TokenEvent(info, self.generated - 1, self.finish)

    def _match_stop(self, new_chars: int) -> tuple[str | None, int | None]:
        """The first stop sequence the text's newest ``new_chars`` characters complete,
        and where it starts."""
        text = self.decoder.text
        for stop in self.request.stopping.stop_sequences:
            at = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
            if at >= 0:
                return stop, at
        return None, None
