"""What importing and exporting a GGUF file costs: wall time and peak memory of each stage,
and the artifact's size against the file's.

Usage (from the repository root, in the dev venv):
    python -m benchmarks export-budget              # the shipped SmolLM2-135M-Instruct Q4_1
    python -m benchmarks export-budget --gguf FILE [--work DIR] [--json OUT.json]
    python -m benchmarks export-budget --ckpt CKPT  # skip the import: export CKPT (imported
                                                    # from a GGUF file) and size against it
    python -m benchmarks export-budget --quantize int4 --no-engine-graph

Each stage is the `attnserve` CLI in a child process of its own:

    import   attnserve import --gguf FILE --out WORK/ckpt --sampling temperature=0
    export   attnserve export --ckpt CKPT --out WORK/artifact --quantize gguf --engine-graph

and its peak resident set is that child's own (``os.wait4``'s ``ru_maxrss``: the largest
the process was, file-backed pages it touched included, as /usr/bin/time -v reports it).
Prints one row a stage, the artifact's bytes on disk and their ratio to the GGUF file's,
and the budget (issue 34: at most 1.5 GB and 60 s for the SmolLM2-135M export; for a 1B
file, import + export at most 2x the file + 1.5 GB and 180 s; reported, never asserted:
timings depend on the machine and on what else runs on it). ``--json``
also writes the figures. Nothing imports this module.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from model.data import write_text_atomic

REPO = Path(__file__).resolve().parents[1]
# issue 34's budgets: the SmolLM2-135M --quantize gguf export (a file of under SMALL_FILE
# bytes) at most 1.5 GB and 60 s; a 1B file's (under ONE_B_FILE: Llama-3.2-1B's Q4_K_M is
# 0.67 GB) import + export at most 2x the file + 1.5 GB and 180 s; a larger file's, the
# same peak and no time
SMALL_FILE, ONE_B_FILE = 300e6, 1.2e9
SMALL_BYTES, SMALL_SECONDS = 1.5e9, 60.0
SIZED_SECONDS = 180.0


def budget(gguf_bytes: int) -> dict[str, Any]:
    """The peak (of any stage) and the seconds (of the stages named) a file is allowed."""
    if gguf_bytes < SMALL_FILE:
        return {"stages": ["export"], "peak_rss_bytes": SMALL_BYTES, "wall_s": SMALL_SECONDS}
    return {"stages": ["import", "export"], "peak_rss_bytes": 2 * gguf_bytes + 1.5e9,
            "wall_s": SIZED_SECONDS if gguf_bytes < ONE_B_FILE else None}


@dataclass(frozen=True)
class Stage:
    name: str
    argv: list[str]
    wall_s: float
    cpu_s: float
    peak_rss_bytes: int
    returncode: int


def rss_bytes(maxrss: int) -> int:
    """``ru_maxrss`` in bytes: Linux counts KiB, macOS bytes."""
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def run_stage(name: str, args: list[str], log: Path, timeout: float | None) -> Stage:
    """``attnserve ARGS`` in a child process, its output appended to ``log``; the child's
    own wall time, CPU time and peak resident set."""
    argv = [sys.executable, "-m", "service.cli", *args]
    with open(log, "a", encoding="utf-8") as out:
        out.write(f"$ {' '.join(argv)}\n")
        out.flush()
        started = time.perf_counter()
        child = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        timer = threading.Timer(timeout, child.kill) if timeout else None
        if timer is not None:
            timer.start()
        try:
            _, status, usage = os.wait4(child.pid, 0)  # this child's rusage, not the sum
        finally:
            if timer is not None:
                timer.cancel()
        child.returncode = os.waitstatus_to_exitcode(status)
    return Stage(name, argv, time.perf_counter() - started, usage.ru_utime + usage.ru_stime,
                 rss_bytes(usage.ru_maxrss), child.returncode)


def source_of(ckpt: Path) -> Path:
    """The GGUF file a checkpoint was imported from (its training.imported_from.path)."""
    record = json.loads((ckpt / "config.json").read_text("utf-8")).get("training", {})
    path = (record.get("imported_from") or {}).get("path")
    if not path:
        raise SystemExit(f"export_budget: {ckpt} was not imported from a GGUF file")
    return Path(path)


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    log = work / "stages.log"
    stages: list[Stage] = []
    if args.ckpt is None:
        ckpt, gguf = work / "ckpt", args.gguf
        stages.append(run_stage("import", ["import", "--gguf", str(gguf), "--out", str(ckpt),
                                           "--force", "--sampling", "temperature=0"],
                                log, args.timeout))
    else:
        ckpt, gguf = args.ckpt, source_of(args.ckpt)
    artifact = work / "artifact"
    if all(s.returncode == 0 for s in stages):
        export = ["export", "--ckpt", str(ckpt), "--out", str(artifact), "--force"]
        if args.quantize != "none":
            export += ["--quantize", args.quantize]
        if args.engine_graph:
            export.append("--engine-graph")
        stages.append(run_stage("export", export, log, args.timeout))
    files = sorted(p for p in artifact.iterdir() if p.is_file()) if artifact.is_dir() else []
    artifact_bytes = sum(p.stat().st_size for p in files)
    gguf_bytes = Path(gguf).stat().st_size
    failed = any(s.returncode != 0 for s in stages)
    return {"gguf": str(gguf), "gguf_bytes": gguf_bytes, "checkpoint": str(ckpt),
            "artifact": str(artifact), "artifact_bytes": artifact_bytes,
            "artifact_to_gguf": artifact_bytes / gguf_bytes if files else None,
            "files": {p.name: p.stat().st_size for p in files},
            "stages": [asdict(s) for s in stages],
            "log_tail": log.read_text("utf-8").splitlines()[-20:] if failed else [],
            "budget": budget(gguf_bytes)}


def table(result: dict[str, Any]) -> str:
    mb = 1e6
    lines = [f"{'stage':<8} {'wall s':>8} {'cpu s':>8} {'peak RSS MB':>12}  exit"]
    for s in result["stages"]:
        lines.append(f"{s['name']:<8} {s['wall_s']:>8.1f} {s['cpu_s']:>8.1f} "
                     f"{s['peak_rss_bytes'] / mb:>12.1f}  {s['returncode']}")
    ratio = result["artifact_to_gguf"]
    lines.append(f"artifact {result['artifact_bytes'] / mb:.1f} MB on disk = "
                 f"{ratio:.2f} x the GGUF file ({result['gguf_bytes'] / mb:.1f} MB)"
                 if ratio is not None else "artifact: none")
    limits = result["budget"]
    counted = [s for s in result["stages"] if s["name"] in limits["stages"]]
    if any(s["name"] == "export" for s in counted):
        peak = max(s["peak_rss_bytes"] for s in counted)
        seconds = sum(s["wall_s"] for s in counted)
        line = (f"{' + '.join(limits['stages'])} budget: peak {peak / 1e9:.2f} GB "
                f"(<= {limits['peak_rss_bytes'] / 1e9:.2f}: "
                f"{'yes' if peak <= limits['peak_rss_bytes'] else 'no'}), {seconds:.0f} s")
        if limits["wall_s"] is not None:
            line += (f" (<= {limits['wall_s']:.0f}: "
                     f"{'yes' if seconds <= limits['wall_s'] else 'no'})")
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks export-budget", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, default=None,
                   help="GGUF file to import (default: the shipped SmolLM2-135M-Instruct)")
    p.add_argument("--ckpt", type=Path, default=None,
                   help="a checkpoint imported from a GGUF file: no import stage")
    p.add_argument("--work", type=Path, default=None,
                   help="directory for the checkpoint, artifact and log (default: a "
                        "temporary one, removed afterwards)")
    p.add_argument("--quantize", default="gguf",
                   choices=["gguf", "int4", "int8", "int8-dynamic", "none"])
    p.add_argument("--no-engine-graph", dest="engine_graph", action="store_false")
    p.add_argument("--timeout", type=float, default=None, help="seconds a stage may run")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    if args.ckpt is None:
        from model.default_model import default_gguf_path

        args.gguf = args.gguf or default_gguf_path()
        if not args.gguf.is_file():
            print(f"export_budget: no GGUF file at {args.gguf} (make default-model, or "
                  "--gguf FILE)", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory(prefix="export-budget-") as scratch:
        work = args.work or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        result = measure(args, work)
    print(table(result))
    if args.json is not None:
        write_text_atomic(args.json, json.dumps(result, indent=2) + "\n")
    failed = [s for s in result["stages"] if s["returncode"] != 0]
    for s in failed:
        print(f"export_budget: {s['name']} exited {s['returncode']}", file=sys.stderr)
    if failed:
        print("\n".join(result["log_tail"]), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
