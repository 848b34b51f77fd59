"""The engine's KV pool under traffic: join/leave throughput vs a static batch, and the
warm shared-prefix TTFT with prefix caching on vs off. Prints figures; asserts nothing.

    python -m benchmarks engine-pool [--preset small | --artifact DIR] [--threads 2]
        [--repeats 3]

Runs the scheduler in process (no HTTP) on engine.onnx exported from a checkpoint of the
preset initialised at random (benchmarks/lib/prepare.py); end-of-sequence is not a stop.

- static: 32 requests submitted at once, one prefill, 32 rows decode to the end together.
- join/leave: the same number of rows kept running (closed loop at concurrency 32) with
  output lengths spread over [n/2, 3n/2]; every finish is replaced by a new request, so
  rows join and leave at almost every step. Figure: generated tokens/s; ratio to static.
  Run with prefix caching on (as served) and off: on random prompts it can only cost.
  Static, on and off are interleaved in every repeat; the figures are medians.
- shared prefix: prompts of a long common prefix (≥ 75 %) plus a short distinct suffix,
  sent one at a time after one warm-up request; median time to first token, on vs off.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.measure import add_threads_option
from service.artifact.loader import open_artifact
from service.contract import io_spec as io
from service.engine.engine import Engine, EngineConfig
from service.engine.request import (
    ErrorEvent,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
)
from service.engine.scheduler import RequestHandle
from service.settings import Settings

BATCH = 32


def engine_artifact(preset: str, work: Path) -> Path:
    """engine.onnx + model.onnx of the preset at random init, exported once into ``work``."""
    out = work / f"{preset}-artifact"
    if (out / "engine.onnx").is_file():
        return out
    from benchmarks.lib.prepare import prepare_checkpoint
    from export.to_onnx import export_artifact

    prep = prepare_checkpoint(preset, work / preset, None)
    return export_artifact(prep.ckpt, out, engine_graph=True, verify=False, force=True)


class Bench:
    """The service's Engine over engine.onnx, on its own event loop."""

    def __init__(self, artifact: Path, threads: int, prefix_blocks: int, chunk: int,
                 mixed_steps: bool = True) -> None:
        opened = open_artifact(Settings.model_validate({"model": artifact,
                                                        "max_batch_tokens": 1 << 20}))
        self.config = opened.config
        block = 16
        token_bytes = self.config.kv_bytes_per_token()
        self.engine = Engine.from_artifact(opened, EngineConfig(
            device="cpu", intra_op_threads=threads, max_batch_size=BATCH,
            max_batch_tokens=1 << 20, max_queued_requests=4096,
            prefix_caching=prefix_blocks > 0, prefix_block_size=block,
            # unread without prefix caching, yet a setting must be valid (> 0)
            prefix_cache_memory_mb=max(prefix_blocks, 1) * block * token_bytes / 2**20,
            prefill_chunk_tokens=chunk, adaptive_prefill_chunks=False,
            mixed_steps=mixed_steps), warmup=False)
        self.loop = asyncio.new_event_loop()
        self.engine.start(self.loop)

    def close(self) -> None:
        self.engine.stop(10)
        self.loop.close()

    @staticmethod
    def request(prompt: list[int], n: int) -> GenerationRequest:
        return GenerationRequest(list(prompt), SamplingParams(), StoppingCriteria(n))

    async def run(self, request: GenerationRequest, handle: RequestHandle | None = None
                  ) -> tuple[int, float]:
        """(tokens generated, time to first token) of one request."""
        if handle is None:
            (handle,) = self.engine.submit([request])
        count, first = 0, 0.0
        async for event in handle.events():
            if isinstance(event, ErrorEvent):
                raise RuntimeError(event.message)
            if count == 0:
                first = time.perf_counter() - request.arrival
            count += 1
        return count, first

    def static(self, prompts: list[list[int]], n: int) -> float:
        async def go() -> int:
            requests = [self.request(p, n) for p in prompts]
            handles = self.engine.submit(requests)  # one wave: one prefill, then decode
            done = await asyncio.gather(*(self.run(r, h)
                                          for r, h in zip(requests, handles, strict=True)))
            return sum(c for c, _ in done)

        start = time.perf_counter()
        tokens = self.loop.run_until_complete(go())
        return tokens / (time.perf_counter() - start)

    def join_leave(self, prompts: list[list[int]], lengths: list[int]) -> float:
        async def go() -> int:
            queue = list(zip(prompts, lengths, strict=True))
            total = 0

            async def worker() -> None:
                nonlocal total
                while queue:
                    prompt, n = queue.pop()
                    count, _ = await self.run(self.request(prompt, n))
                    total += count  # after the await: `total += await ...` would lose updates

            await asyncio.gather(*(worker() for _ in range(BATCH)))
            return total

        start = time.perf_counter()
        tokens = self.loop.run_until_complete(go())
        return tokens / (time.perf_counter() - start)

    def ttft(self, prompt: list[int], n: int) -> float:
        return self.loop.run_until_complete(self.run(self.request(prompt, n)))[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--artifact", type=Path,
                        help="an exported artifact with engine.onnx (a real model) instead "
                             "of the preset at random init")
    parser.add_argument("--work", type=Path, default=Path(".cache/engine_pool"))
    add_threads_option(parser)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-mixed-steps", dest="mixed_steps", action="store_false",
                        help="engine.onnx instead of the artifact's engine_mixed.onnx")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--waves", type=int, default=3, help="join/leave requests = waves x 32")
    args = parser.parse_args(argv)

    artifact = args.artifact or engine_artifact(args.preset, args.work)
    config = io.ArtifactConfig.load(artifact)
    rng = random.Random(0)
    vocab = config.vocab_size

    def prompt(length: int) -> list[int]:
        return [rng.randrange(4, vocab) for _ in range(length)]

    n = args.new_tokens
    source = f"artifact {artifact}" if args.artifact else f"preset {args.preset} (random init)"
    print(f"{source}: d_model {config.d_model}, layers "
          f"{config.n_layers}, context {config.max_seq_len}; {args.threads} threads; "
          f"pool {BATCH} slots; {'engine_mixed.onnx' if args.mixed_steps else 'engine.onnx'}")

    # -- throughput: static batch vs join/leave traffic, prefix caching on (as served) and
    # off (random prompts: caching can only cost); the three interleaved in every repeat,
    # so a change in the machine's load moves all three alike.
    engine = Bench(artifact, args.threads, prefix_blocks=4096, chunk=256,
                   mixed_steps=args.mixed_steps)
    plain = Bench(artifact, args.threads, prefix_blocks=0, chunk=256,
                  mixed_steps=args.mixed_steps)
    for warm in (engine, plain):
        warm.static([prompt(args.prompt_len) for _ in range(BATCH)], 8)
    static: list[float] = []
    joined: list[float] = []
    uncached: list[float] = []
    count = args.waves * BATCH
    for _ in range(args.repeats):
        static.append(engine.static([prompt(args.prompt_len) for _ in range(BATCH)], n))
        for runs, eng in ((joined, engine), (uncached, plain)):
            lengths = [rng.randint(n // 2, 3 * n // 2) for _ in range(count)]
            runs.append(eng.join_leave([prompt(args.prompt_len) for _ in range(count)],
                                       lengths))
    moves = engine.engine.kv_stats().rows_moved
    engine.close()
    plain.close()
    s, j = statistics.median(static), statistics.median(joined)
    u = statistics.median(uncached)
    print(f"static batch {BATCH} x {n} tokens:         {s:8.1f} tok/s (median of "
          f"{args.repeats}: {', '.join(f'{v:.1f}' for v in static)})")
    print(f"join/leave at concurrency {BATCH}:         {j:8.1f} tok/s (median of "
          f"{args.repeats}: {', '.join(f'{v:.1f}' for v in joined)})")
    print(f"join/leave / static:                  {j / s:8.2f}x   (rows moved in the pool: "
          f"{moves})")
    print(f"join/leave, prefix caching off:       {u:8.1f} tok/s (median of "
          f"{args.repeats}: {', '.join(f'{v:.1f}' for v in uncached)}); on / off "
          f"{j / u:.2f}x")

    # -- warm shared-prefix TTFT: prefix caching on vs off ---------------------------------
    total = min(config.max_seq_len - 16, 4 * args.prompt_len + 64)
    prefix = prompt(int(total * 0.8))
    suffixes = [prompt(total - len(prefix)) for _ in range(8 * args.repeats)]
    result: dict[str, Any] = {}
    for label, blocks in (("on", 4096), ("off", 0)):
        engine = Bench(artifact, args.threads, prefix_blocks=blocks, chunk=0)
        engine.ttft(prefix + prompt(8), 4)  # warm-up (fills the cache when on)
        result[label] = [engine.ttft(prefix + sfx, 4) for sfx in suffixes]
        engine.close()
    on, off = statistics.median(result["on"]), statistics.median(result["off"])
    print(f"shared prefix {len(prefix)} of {total} prompt tokens, warm, one at a time:")
    print(f"  TTFT prefix caching off: {off * 1000:8.2f} ms (median of {len(suffixes)})")
    print(f"  TTFT prefix caching on:  {on * 1000:8.2f} ms")
    print(f"  off / on:                {off / on:8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
