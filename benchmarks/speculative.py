"""Speculative decoding on and off, batch 1, on a served model's own chat template.

Usage:
    python -m benchmarks.speculative --artifact artifacts/smollm2-135m-instruct \
        [--threads 2] [--max-new 128] [--reps 3] [--k 4] [--draft DIR] [--no-adaptive] \
        [--prompts SETS.json] [--out FILE.json]

Two prompt sets: ``repetitive`` (code editing, extraction and summarising with quotes:
the answer copies long stretches of the prompt, where prompt lookup pays) and ``chat``
(free questions, where it should cost next to nothing), or your own (``--prompts``).
Each prompt is decoded greedily with speculation off and on, alternating, ``--reps``
times; the report gives tokens/s (median over reps of each prompt, summed over the set),
the ratio on/off, the acceptance rate (accepted / drafted) and whether every greedy text
was identical on and off. ``--no-adaptive`` proposes at every step, to measure a draft's
acceptance where the engine would have stopped proposing.
The engine is built in-process exactly as the server builds it (Engine.from_artifact).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

CODE = '''def compute_total(prices, tax_rate):
    subtotal = 0
    for price in prices:
        subtotal += price
    tax = subtotal * tax_rate
    total = subtotal + tax
    return round(total, 2)


def describe_order(order):
    lines = []
    for item, price in order.items():
        lines.append(f"{item}: {price:.2f}")
    lines.append(f"total: {compute_total(order.values(), 0.2):.2f}")
    return "\\n".join(lines)
'''
STORY = ("The village of Arden sat on the bend of a slow green river. Every spring the river "
         "rose and the miller, Tomas Reed, moved his sacks of flour to the upper floor. "
         "\"The river gives and the river takes,\" he told his daughter Mira each year. In "
         "the spring of 1902 the water came higher than anyone remembered, and the whole "
         "village climbed the hill to the chapel, where they waited for three days. When the "
         "water went down, the mill still stood, and Tomas said only: \"It gave more than "
         "it took.\"")
REPETITIVE = [
    f"Rename the function compute_total to sum_with_tax everywhere in this code, and "
    f"return the whole code:\n\n{CODE}",
    f"Add a docstring to each function of this code and return the whole code:\n\n{CODE}",
    f"Copy, word for word, the two sentences of this text that Tomas says:\n\n{STORY}",
    f"Summarise this text in three sentences, quoting the miller's words exactly:\n\n{STORY}",
    "Rewrite this list as a JSON array of objects with keys name and city:\n"
    "Alice Martin, Paris\nBob Chen, London\nCarla Diaz, Madrid\nDavid Okafor, Lagos\n"
    "Eva Novak, Prague\nFrank Moreau, Lyon",
]
CHAT = [
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Write a short poem about the sea.",
    "Explain in simple words what a neural network is.",
    "What should I cook tonight with rice, eggs and spinach?",
]


def build_engine(artifact_dir: Path, threads: int, **speculation: Any) -> Any:
    """An engine on one row; ``speculation``: its speculative_* settings (none: off)."""
    from service.artifact.loader import open_artifact
    from service.contract.io_spec import ArtifactConfig
    from service.engine.engine import Engine, EngineConfig
    from service.settings import Settings

    total = min(2048, ArtifactConfig.load(artifact_dir).max_seq_len)  # the prompts fit in 1k
    artifact = open_artifact(Settings.model_validate({"model": artifact_dir,
                                                      "max_total_tokens": total}))
    return artifact, Engine.from_artifact(artifact, EngineConfig(
        device="cpu", intra_op_threads=threads, max_batch_size=1, max_total_tokens=total,
        prefix_caching=False, prefill_chunk_tokens=0, **speculation))


async def decode(engine: Any, prompt: list[int], max_new: int, eos: tuple[int, ...] = ()
                 ) -> tuple[list[int], float]:
    """Greedy tokens (stopping at end-of-sequence) and decode tokens/s after the first."""
    from service.engine.request import (
        ErrorEvent,
        GenerationRequest,
        SamplingParams,
        StoppingCriteria,
    )

    stopping = StoppingCriteria(max_new_tokens=max_new, eos_token_id=eos[0] if eos else None,
                                extra_eos_ids=eos[1:])
    (handle,) = engine.submit([GenerationRequest(prompt, SamplingParams(), stopping)])
    tokens: list[int] = []
    first = 0.0
    async for event in handle.events():
        if isinstance(event, ErrorEvent):
            raise RuntimeError(event.message)
        if not tokens:
            first = time.perf_counter()
        tokens.append(event.token.id)
    # Decode speed: tokens after the first over the time after the first (prefill excluded).
    elapsed = time.perf_counter() - first
    return tokens, (len(tokens) - 1) / elapsed if len(tokens) > 1 else 0.0


def prompt_sets(path: Path | None) -> dict[str, list[str]]:
    """The built-in sets, or a JSON file's: {"set name": ["prompt", ...], ...}."""
    if path is None:
        return {"repetitive": REPETITIVE, "chat": CHAT}
    try:
        sets = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--prompts {path}: {exc}") from None
    if not (isinstance(sets, dict) and sets and all(
            isinstance(v, list) and v and all(isinstance(t, str) for t in v)
            for v in sets.values())):
        raise SystemExit(f"--prompts {path}: expected {{\"set name\": [\"prompt\", ...]}}")
    return sets


def run(args: argparse.Namespace) -> dict[str, Any]:
    sets = prompt_sets(args.prompts)
    artifact, plain = build_engine(args.artifact, args.threads)
    _, fast = build_engine(args.artifact, args.threads,
                           speculative_model=str(args.draft) if args.draft else "ngram",
                           num_speculative_tokens=args.k, speculative_adaptive=args.adaptive)
    loop = asyncio.new_event_loop()
    plain.start(loop)
    fast.start(loop)
    template = artifact.chat_template
    codec = artifact.codec
    eos = (artifact.config.eos_token_id, *artifact.extra_eos_ids)
    report: dict[str, Any] = {"artifact": str(args.artifact), "threads": args.threads,
                              "max_new_tokens": args.max_new, "reps": args.reps,
                              "num_speculative_tokens": args.k, "adaptive": args.adaptive,
                              "method": "draft" if args.draft else "ngram", "sets": {}}
    try:
        loop.run_until_complete(decode(plain, codec.encode("Hello", False), 4))  # warm-up
        loop.run_until_complete(decode(fast, codec.encode("Hello", False), 4))
        for name, prompts in sets.items():
            rows: list[dict[str, Any]] = []
            before = replace(fast.scheduler.speculator.counters)
            for text in prompts:
                ids = codec.encode(template.render([{"role": "user", "content": text}]), False)
                off_speeds, on_speeds, identical = [], [], True
                off_tokens: list[int] = []
                for _ in range(args.reps):
                    off_tokens, off = loop.run_until_complete(decode(plain, ids, args.max_new, eos))
                    on_tokens, on = loop.run_until_complete(decode(fast, ids, args.max_new, eos))
                    off_speeds.append(off)
                    on_speeds.append(on)
                    identical &= on_tokens == off_tokens
                rows.append({"prompt": text[:60], "prompt_tokens": len(ids),
                             "new_tokens": len(off_tokens),
                             "off_tok_s": statistics.median(off_speeds),
                             "on_tok_s": statistics.median(on_speeds),
                             "identical": identical})
            after = fast.scheduler.speculator.counters
            drafted = after.draft_tokens - before.draft_tokens
            accepted = after.accepted_tokens - before.accepted_tokens
            off_total = sum(r["new_tokens"] / r["off_tok_s"] for r in rows)
            on_total = sum(r["new_tokens"] / r["on_tok_s"] for r in rows)
            tokens = sum(r["new_tokens"] for r in rows)
            report["sets"][name] = {
                "prompts": rows, "off_tok_s": tokens / off_total, "on_tok_s": tokens / on_total,
                "speedup": off_total / on_total,
                "acceptance_rate": accepted / drafted if drafted else 0.0,
                "drafted": drafted, "accepted": accepted,
                "identical": all(r["identical"] for r in rows)}
    finally:
        plain.stop(10)
        fast.stop(10)
        loop.close()
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", type=Path, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--k", type=int, default=4, help="tokens drafted per pass")
    p.add_argument("--draft", type=Path, default=None, help="draft model artifact (else ngram)")
    p.add_argument("--prompts", type=Path, default=None,
                   help='JSON {"set name": ["prompt", ...]} instead of the built-in sets')
    p.add_argument("--no-adaptive", dest="adaptive", action="store_false",
                   help="propose at every step even where it does not pay (the draft's "
                        "acceptance rate over every position, not the engine's speed)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    report = run(args)
    for name, s in report["sets"].items():
        print(f"{name:10s} off {s['off_tok_s']:6.1f} tok/s  on {s['on_tok_s']:6.1f} tok/s  "
              f"x{s['speedup']:.2f}  acceptance {s['acceptance_rate']:.2f} "
              f"({s['accepted']}/{s['drafted']})  identical {s['identical']}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
