"""Fine-tuning speed and memory: `attnserve finetune` beside PEFT + transformers, one run.

Usage (from the repository root, in the dev venv):
    python -m benchmarks finetune-speed --ckpt checkpoints/smollm2-135m-instruct \\
        --data model/finetune/demo/train.jsonl --steps 24 [--full] [--rounds 2]
    python -m benchmarks finetune-speed --ckpt CKPT_1B --data ... --steps 4 \\
        --engines ours --gradient-checkpointing          # memory at 1B

Both engines train on the same token ids and labels, in the same batches, with the same
hyper-parameters: the data is prepared once by our own pipeline (model/finetune/dataset.py:
the checkpoint's chat template, assistant-only labels), cut into our length-grouped
batches (model/finetune/batches.py), and each step's batch is fed to both. PEFT's side is
what a user of TRL would run: transformers' model of the same weights (a GGUF checkpoint's
file read by transformers' GGUF loader, else `export --format hf`'s copy), float32,
``get_peft_model`` with LoRA r/alpha/dropout on the same projections (or every parameter
with --full), right-padded batches with an attention mask, transformers' own shifted
loss, fused AdamW (β 0.9/0.999; the Trainer's default), clipping at 1.0 and our warm-up
+ cosine schedule. Ours is `attnserve finetune` itself.

Every engine and round runs in its own process, in turn (ours, theirs, ours, ...), so the
peak resident set (ru_maxrss) is that engine's and a busy machine slows both alike.
Tokens/s: tokens fed (padding excluded) over the time spent in training steps (loading
and evaluation excluded). Printed: the median tokens/s and peak RSS per engine, their
ratio, and both loss curves side by side; ``--json`` writes everything.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.measure import add_threads_option

ENGINES = ("ours", "peft")


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_ours(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from model.finetune.options import FinetuneOptions
    from model.finetune.trainer import finetune

    result = finetune(FinetuneOptions(
        ckpt=args.ckpt, data=args.data, out=str(out), eval_fraction=0.0, full=args.full,
        steps=args.steps, lr=args.lr, batch_size=args.batch_size, seed=args.seed,
        gradient_checkpointing=args.gradient_checkpointing, progress=False, verbose=False,
        force=True, rehearsal=0))  # the same examples as the PEFT run
    assert result is not None
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train_loss"] for r in rows if "train_loss" in r]
    return {"tokens_per_s": result.tokens_per_second, "peak_rss": _peak_rss(),
            "losses": losses, "trained_parameters": result.trained_parameters,
            "held_bytes": result.held_bytes}


def _transformers_model(ckpt: Path, work: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    from model.checkpoint import GGUF_WEIGHTS_FILE, weights_path

    if weights_path(ckpt).name == GGUF_WEIGHTS_FILE:
        return AutoModelForCausalLM.from_pretrained(str(ckpt), gguf_file=GGUF_WEIGHTS_FILE,
                                                    dtype=torch.float32)
    from export.to_hf import export_hf

    export_hf(ckpt, work / "hf")
    return AutoModelForCausalLM.from_pretrained(str(work / "hf"), dtype=torch.float32)


def run_peft(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """PEFT + transformers on our batches (see the module docstring)."""
    import peft
    import torch

    from model.finetune.batches import BatchPlan
    from model.finetune.dataset import prepare
    from model.finetune.lora import targets_of
    from model.finetune.options import FinetuneOptions
    from model.finetune.supervision import IGNORE
    from model.training_loop import lr_at

    opts = FinetuneOptions(ckpt=args.ckpt, data=args.data, out=str(work / "unused"),
                           eval_fraction=0.0, full=args.full, steps=args.steps, lr=args.lr,
                           batch_size=args.batch_size, seed=args.seed, rehearsal=0)
    data = prepare(opts)
    torch.manual_seed(args.seed)
    model = _transformers_model(Path(args.ckpt), work)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
            "use_reentrant": False})
        model.config.use_cache = False
    if args.full:
        trained = model
    else:
        kinds = list(dict.fromkeys(t.kind for t in targets_of(data.meta.model)))
        trained = peft.get_peft_model(model, peft.LoraConfig(
            r=opts.rank, lora_alpha=int(opts.alpha), lora_dropout=opts.dropout,
            target_modules=kinds, task_type="CAUSAL_LM"))
    trained.train()
    params = [p for p in trained.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=opts.learning_rate, betas=(0.9, 0.999),
                                  weight_decay=0.0, fused=True)  # Trainer's default optim
    lengths = [len(e.ids) for e in data.train]
    per_epoch = math.ceil(len(lengths) / opts.batch_size)
    plan = BatchPlan.build(lengths, opts.batch_size, math.ceil((args.steps + 1) / per_epoch),
                           opts.seed, 1, 1)
    losses, seconds, tokens = [], 0.0, 0
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step / args.steps, opts.learning_rate, opts.warmup)
        (batch,) = plan.step(step)
        rows = [data.train[i] for i in batch]
        width = max(len(r.ids) for r in rows)
        ids = torch.full((len(rows), width), data.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, row in enumerate(rows):
            ids[r, :len(row.ids)] = torch.tensor(row.ids)
            labels[r, :len(row.ids)] = torch.tensor(row.labels)
            mask[r, :len(row.ids)] = 1
        labels[:, 0] = IGNORE  # never scored (transformers shifts it away anyway)
        started = time.perf_counter()
        loss = trained(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds += time.perf_counter() - started
        tokens += sum(len(r.ids) for r in rows)
        losses.append(float(loss))
    return {"tokens_per_s": tokens / seconds, "peak_rss": _peak_rss(), "losses": losses,
            "trained_parameters": sum(p.numel() for p in params), "held_bytes": 0}


def child(args: argparse.Namespace) -> None:
    """One engine's run in this process; its figures as one JSON line on stdout."""
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="finetune-bench-") as tmp:
        work = Path(tmp)
        figures = (run_ours(args, work / "out") if args.child == "ours"
                   else run_peft(args, work))
    print("RESULT " + json.dumps(figures), flush=True)


def spawn(engine: str, argv: list[str]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.finetune_speed", *argv,
                           "--child", engine], capture_output=True, text=True, check=False,
                          env={**os.environ, "TQDM_DISABLE": "1"})
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"{engine} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}")
    figures: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return figures


def report(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    mib = 2 ** 20
    file_size = sum(p.stat().st_size for p in Path(args.ckpt).iterdir()
                    if p.name in ("model.gguf", "model.safetensors"))
    print(f"\n{'full fine-tune' if args.full else 'LoRA'} of {args.ckpt} "
          f"(weights file {file_size / mib:,.0f} MiB), {args.steps} steps of "
          f"{args.batch_size} examples, {args.threads} threads, {args.rounds} round(s)"
          f"{', gradient checkpointing' if args.gradient_checkpointing else ''}")
    print("| engine | tokens/s (median; rounds) | peak RSS MiB (max) | trained parameters |")
    print("|---|---|---|---|")
    medians = {}
    for engine, rounds in runs.items():
        speeds = [r["tokens_per_s"] for r in rounds]
        medians[engine] = statistics.median(speeds)
        print(f"| {engine} | {medians[engine]:,.0f} ({', '.join(f'{s:,.0f}' for s in speeds)})"
              f" | {max(r['peak_rss'] for r in rounds) / mib:,.0f} | "
              f"{rounds[0]['trained_parameters']:,} |")
    if len(medians) == 2:
        print(f"ours ÷ peft tokens/s: {medians['ours'] / medians['peft']:.2f}")
        a, b = runs["ours"][0]["losses"], runs["peft"][0]["losses"]
        print("step | loss ours | loss peft")
        for k in range(len(a)):
            print(f"{k + 1:4d} | {a[k]:.4f} | {b[k]:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--rounds", type=int, default=1)
    add_threads_option(parser)
    parser.add_argument("--json", default=None, metavar="FILE")
    parser.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    argv = ["--ckpt", args.ckpt, "--data", args.data, "--steps", str(args.steps),
            "--batch-size", str(args.batch_size), "--seed", str(args.seed),
            "--threads", str(args.threads), *(["--lr", str(args.lr)] if args.lr else []),
            *(["--full"] if args.full else []),
            *(["--gradient-checkpointing"] if args.gradient_checkpointing else [])]
    runs: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
    for r in range(args.rounds):
        for engine in engines:
            figures = spawn(engine, argv)
            runs[engine].append(figures)
            print(f"round {r + 1} {engine}: {figures['tokens_per_s']:,.0f} tokens/s, peak RSS "
                  f"{figures['peak_rss'] / 2**20:,.0f} MiB", flush=True)
    report(runs, args)


if __name__ == "__main__":
    main()
