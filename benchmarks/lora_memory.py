"""Memory per resident LoRA adapter: the server's RSS as each of K adapters takes its slot.

Usage (from the repository root, in the dev venv):
    python -m benchmarks lora-adapters --model artifacts/smollm2-135m-instruct-lora \\
        --out adapters/bench --count 4 --rank 16
    python -m benchmarks lora-memory --model artifacts/smollm2-135m-instruct-lora \\
        --adapters-dir adapters/bench --adapters lora0,lora1,lora2,lora3 \\
        --out results/lora-memory.json -- --max-total-tokens 4096
    # the same adapters loaded at run time (POST /v1/load_lora_adapter), one at a time
    python -m benchmarks lora-memory --model artifacts/smollm2-135m-instruct-lora \
        --adapters-dir adapters/bench --runtime -- --max-total-tokens 4096

Starts `attnserve serve` with the K adapters (``--lora-modules``, ``--max-loras K``,
``--max-lora-rank`` their largest r), sends one greedy request to the base (so that what a
first request allocates is not put down to an adapter), then one request per adapter in
turn, each placing that adapter in a slot of its own, and reads the server's memory
(/proc/PID/status: VmRSS, RssAnon, RssFile) after each. A second pass over the same
adapters, all resident by then, shows what steps remain once nothing new is placed. Each
step is set beside the adapter's file (adapter_model.safetensors) and the server's own
figure of its tensors (``attnserve_lora_resident_bytes``); the answers to the one question
show that each adapter changes what the model says. With --runtime the server starts with
none (``--runtime-lora --lora-dir ADAPTERS_DIR``) and each adapter is first loaded by
vLLM's route (the "load" step: its tensors read), then placed by its request (the
"resident" step). Prints one JSON object; --out writes it atomically.

Read it knowing how adapters are held (service/engine/adapters.py): an adapter's tensors
are read when it is named (--lora-modules: at start, already in "ready"; --runtime: at its
load), kept until it is first placed in a slot, then dropped (the slot holds it); the slot
buffers, K·R rows per module, are allocated zeroed at start and reach RSS only as a slot
is written. So a resident step is the slot's pages less whatever of the dropped copy the
allocator gives back, and load + resident is what one more resident adapter costs.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.lib import serving
from benchmarks.serve import client as load
from service.contract.peft_adapter import WEIGHTS_FILE

QUESTION = "What is the capital of France?"


def _mib(n: float) -> float:
    return serving.mib(n, 2)


async def ask(client: aiohttp.ClientSession, model: str, max_tokens: int) -> str:
    out = await load.chat_request(client, {
        "model": model, "max_tokens": max_tokens, "temperature": 0.0,
        "messages": [{"role": "user", "content": QUESTION}]}, load.RequestOutput())
    if not out.success:
        raise RuntimeError(f"{model}: {out.error}")
    return out.generated_text


def reading(pid: int, before: dict[str, int], prefix: str = "") -> tuple[dict[str, Any],
                                                                         dict[str, int]]:
    """(the figures now and their steps from ``before``, in MiB; the raw reading)."""
    now = serving.memory(pid)
    return {**{f"{prefix}{k}_mib": _mib(v) for k, v in now.items()},
            **{f"{prefix}{k}_step_mib": _mib(now[k] - before[k]) for k in now if k in before}
            }, now


async def step(client: aiohttp.ClientSession, url: str, pid: int, model: str, max_tokens: int,
               before: dict[str, int], settle: float) -> tuple[dict[str, Any], dict[str, int]]:
    answer = await ask(client, model, max_tokens)
    await asyncio.sleep(settle)  # the engine thread's frees after the answer
    figures, now = reading(pid, before)
    page, _ = serving.http_get(f"{url}/metrics")
    resident = serving.metric(page, "attnserve_lora_resident_bytes")
    return {"model": model, "answer": answer, **figures,
            "lora_resident_mib": None if resident is None else _mib(resident)}, now


async def load_adapter(client: aiohttp.ClientSession, pid: int, name: str, directory: Path,
                       before: dict[str, int], settle: float
                       ) -> tuple[dict[str, Any], dict[str, int]]:
    """POST /v1/load_lora_adapter, then the memory: what holding its tensors costs."""
    if not (out := await load.lora_adapter(client, name, str(directory.resolve()))).success:
        raise RuntimeError(f"loading {name}: {out.error}")
    await asyncio.sleep(settle)
    return reading(pid, before, "load_")


async def measure(url: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    base = serving.served_model(url)
    async with load.session(url) as client:
        ready = serving.memory(pid)
        row, now = await step(client, url, pid, base, args.max_tokens, ready, args.settle)
        passes: list[list[dict[str, Any]]] = []
        for pass_number in range(2):
            rows = []
            for name in args.adapters:
                loaded: dict[str, Any] = {}
                if args.runtime and pass_number == 0:
                    loaded, now = await load_adapter(client, pid, name, args.adapters_dir / name,
                                                     now, args.settle)
                entry, now = await step(client, url, pid, name, args.max_tokens, now,
                                        args.settle)
                size = (args.adapters_dir / name / WEIGHTS_FILE).stat().st_size
                entry |= loaded
                entry["file_mib"] = _mib(size)
                total = entry["VmRSS_step_mib"] + loaded.get("load_VmRSS_step_mib", 0.0)
                entry["rss_step_over_file"] = round(total / entry["file_mib"], 3)
                rows.append(entry)
            passes.append(rows)
    first = passes[0]
    return {"model": base, "adapters": args.adapters, "max_loras": len(args.adapters),
            "max_lora_rank": args.rank, "runtime": args.runtime,
            "ready": {f"{k}_mib": _mib(v) for k, v in ready.items()},
            "base_request": row, "first_pass": first, "second_pass": passes[1],
            "mean_rss_step_mib": round(sum(
                r["VmRSS_step_mib"] + r.get("load_VmRSS_step_mib", 0.0) for r in first)
                / len(first), 2),
            "mean_file_mib": round(sum(r["file_mib"] for r in first) / len(first), 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks lora-memory",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="artifact to serve")
    serving.add_adapter_options(parser)
    parser.add_argument("--runtime", action="store_true",
                        help="start with no adapter; load each at run time before its request")
    serving.add_server_options(parser, port=8152)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--settle", type=float, default=0.5,
                        help="seconds between an answer and the reading (default 0.5)")
    args = parser.parse_args(argv)
    if not args.adapters:
        parser.error("--adapters names no adapter")
    args.rank = serving.max_rank(args.adapters_dir, args.adapters)
    adapters = (["--runtime-lora", "--lora-dir", str(args.adapters_dir)] if args.runtime else
                ["--lora-modules", *serving.lora_modules(args.adapters_dir, args.adapters)])
    server_args = [*adapters, "--max-loras", str(len(args.adapters)),
                   "--max-lora-rank", str(args.rank), *args.server_args]
    with serving.started(args.model, args.port, server_args, "lora_memory") as server:
        try:
            result = asyncio.run(measure(server.url, server.pid, args))
        except (RuntimeError, *load.CLIENT_ERRORS) as exc:
            print(f"lora_memory: error: {exc}", file=sys.stderr)
            return 2
    serving.emit(result, args.out, ensure_ascii=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
