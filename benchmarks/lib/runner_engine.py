"""Our serving engine called directly: the scheduler loop and the IO-bound ORT session,
without HTTP. ``generate`` submits the whole batch at once, so the scheduler admits it as
one static batch (one prefill, then decode together); end-of-sequence is not a stop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.lib.measure import GenResult
from service.contract import io_spec as io
from service.engine.request import ControlChoice
from service.engine.scheduler import RequestHandle
from service.settings import Device


class EngineRunner:
    def __init__(self, artifact_dir: Path, threads: int, name: str = "engine",
                 max_len: int | None = None, device: Device = "cpu",
                 cuda_graphs: bool = True, max_batch_size: int = 64,
                 control_vectors: Sequence[str] = ()) -> None:
        """``max_len``: tokens per KV slot (the server's --max-total-tokens), default the
        model's context; ``device``, ``cuda_graphs``, ``max_batch_size`` and
        ``control_vectors`` (NAME=FILE each): the server's flags of those names."""
        from service.artifact.loader import open_artifact
        from service.engine.engine import Engine, EngineConfig
        from service.settings import Settings

        self.name = name
        config = io.ArtifactConfig.load(artifact_dir)
        max_total = None if max_len is None else min(max_len, config.max_seq_len)
        artifact = open_artifact(Settings.model_validate({
            "model": artifact_dir, "max_total_tokens": max_total, "max_batch_tokens": 1 << 20}))
        self.eos_token_id = config.eos_token_id
        self.extra_eos_ids = artifact.extra_eos_ids
        # One static batch: no prefix cache, no chunking, no mixed steps (nobody joins:
        # engine.onnx, not engine_mixed.onnx); end-of-sequence is not a stop.
        self.engine = Engine.from_artifact(artifact, EngineConfig(
            device=device, intra_op_threads=threads, max_batch_size=max_batch_size,
            cuda_graphs=cuda_graphs, control_vectors=tuple(control_vectors),
            max_batch_tokens=1 << 20, max_queued_requests=1024, max_total_tokens=max_total,
            prefix_caching=False, prefill_chunk_tokens=0, mixed_steps=False), warmup=False)
        self.loop = asyncio.new_event_loop()
        self.engine.start(self.loop)

    def generate(self, prompts: list[list[int]], n_new: int,
                 controls: Sequence[ControlChoice | None] | None = None) -> GenResult:
        """Exactly ``n_new`` greedy tokens per row (end-of-sequence is not a stop);
        ``controls``: row i's control vector, one the engine serves (None: none)."""
        return self.generate_until(prompts, [n_new] * len(prompts), stop_at_eos=False,
                                   controls=controls)

    def generate_until(self, prompts: list[list[int]], max_new: list[int],
                       stop_at_eos: bool,
                       controls: Sequence[ControlChoice | None] | None = None) -> GenResult:
        """Greedy, up to ``max_new[i]`` tokens for row i; with ``stop_at_eos`` a row also ends
        at the model's end tokens, as the server ends it (the batch runs on without it)."""
        return self.loop.run_until_complete(self._generate(
            prompts, max_new, stop_at_eos, controls or [None] * len(prompts)))

    async def _generate(self, prompts: list[list[int]], max_new: list[int],
                        stop_at_eos: bool,
                        controls: Sequence[ControlChoice | None]) -> GenResult:
        from service.engine.request import (
            ErrorEvent,
            GenerationRequest,
            SamplingParams,
            StoppingCriteria,
        )

        eos = self.eos_token_id if stop_at_eos else None
        extra = self.extra_eos_ids if stop_at_eos else ()
        # No log-probabilities (an OpenAI request without ``logprobs``): the peers measured
        # beside us compute none, and each costs an exp over the vocabulary (0.2 ms a row
        # on SmolLM2's 49,152 tokens).
        requests = [GenerationRequest(prompt_ids=list(p), sampling=SamplingParams(),
                                      stopping=StoppingCriteria(
                                          max_new_tokens=n, eos_token_id=eos,
                                          extra_eos_ids=extra), token_logprobs=False,
                                      control_vector=c)
                    for p, n, c in zip(prompts, max_new, controls, strict=True)]
        t0 = time.perf_counter()
        handles = self.engine.submit(requests)

        async def collect(handle: RequestHandle) -> tuple[list[int], float, float]:
            tokens: list[int] = []
            first = 0.0
            async for event in handle.events():
                if isinstance(event, ErrorEvent):
                    raise RuntimeError(f"engine error: {event.message}")
                if not tokens:
                    first = time.perf_counter() - t0
                tokens.append(event.token.id)
            return tokens, first, time.perf_counter() - t0

        done = await asyncio.gather(*(collect(h) for h in handles))
        total = time.perf_counter() - t0
        return GenResult(tokens=[d[0] for d in done], ttft_s=max(d[1] for d in done),
                         total_s=total, latencies=[d[2] for d in done])

    def close(self) -> None:
        self.engine.stop(timeout=10)
        self.loop.close()
