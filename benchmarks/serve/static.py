"""The static-batch reference for a continuous-batching run: the same requests, in process.

Continuous batching is judged against the batching it replaces: the same prompts, taken
``batch`` at a time in the order they were sent, each batch prefilled together and decoded
together until its last row ends, then the next batch (what a server without joins does).
It runs our engine directly (engine.onnx, no HTTP, no prefix cache, no chunking, no mixed
steps: benchmarks/lib/runner_engine.py), greedy like the HTTP run, with the same thread count.
Rows stop where the server stops them: at ``max_new_tokens``, and at the model's end tokens
unless the run asked the server to ignore them. Output throughput counts generated tokens
over the wall time of all batches, prefills included, as the HTTP run's does.

This machine's speed drifts by 10-20 % over a minute when it is shared, so the reference
is measured right before and right after the HTTP runs (the server idle) and the ratio
uses their mean: a drift that a single measurement would fold into the ratio shows up as
the two disagreeing. With ``--rounds N`` the HTTP runs are repeated and the reference is
measured between rounds too, so each round's ratio uses the two measurements around it,
and the figure reported is the median of the rounds' ratios (drift within a round cancels;
a round disturbed by something else on the machine does not move the median).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.serve.workloads import SampleRequest


class StaticBaseline:
    def __init__(self, artifact: Path, requests: list[SampleRequest], batch: int,
                 threads: int, ignore_eos: bool) -> None:
        from benchmarks.lib.runner_engine import EngineRunner
        from service.artifact.text import TextCodec

        codec = TextCodec.from_file(artifact / "tokenizer.json")
        # The server's tokenization of a raw prompt (/generate and /v1/completions).
        prompts = [codec.encode(r.prompt, add_special_tokens=True) for r in requests]
        limits = [r.expected_output_len for r in requests]
        self.groups = [(prompts[i:i + batch], limits[i:i + batch])
                       for i in range(0, len(prompts), batch)]
        self.batch, self.threads, self.ignore_eos = batch, threads, ignore_eos
        self.runs: list[dict[str, float]] = []
        # KV slots as long as the longest request needs (the server's --max-total-tokens).
        longest = max(len(p) + n for p, n in zip(prompts, limits, strict=True))
        self.runner = EngineRunner(artifact, threads, name="static", max_len=longest)

    def measure(self) -> None:
        """One pass over every batch, timed (the first call warms up on the first batch's
        shapes first, as every engine row of the harness is warmed)."""
        if not self.runs:
            self.runner.generate(self.groups[0][0], 4)
        generated = 0
        t0 = time.perf_counter()
        for prompts, limits in self.groups:
            result = self.runner.generate_until(prompts, limits, stop_at_eos=not self.ignore_eos)
            generated += sum(len(tokens) for tokens in result.tokens)
        duration = time.perf_counter() - t0
        self.runs.append({"output_tokens": generated, "duration": duration,
                          "output_throughput": generated / duration})

    def result(self, continuous_throughput: float, round_index: int = 0) -> dict[str, Any]:
        """The reference for a run of round ``round_index`` (0-based): the mean of the
        measurements before and after that round."""
        around = self.runs[round_index:round_index + 2]
        reference = statistics.mean(r["output_throughput"] for r in around)
        return {"batch": self.batch, "batches": len(self.groups), "ignore_eos": self.ignore_eos,
                "threads": self.threads, "runs": around,
                "output_tokens": around[0]["output_tokens"],
                "output_throughput": reference,
                "continuous_vs_static": continuous_throughput / reference,
                "engine": "engine.onnx in process: static batches, no prefix cache, no chunks"}

    def close(self) -> None:
        self.runner.close()
