"""The whole suite on a busy machine, in a random order: what `make test-stress` runs.

Usage: python tests/stress.py [--runs 3] [--seeds S1,S2,...] [--hogs N] [-- PYTEST_ARGS...]

A test that passes only on a quiet machine, or only after another test, is a test that
fails for a newcomer. So every core is kept busy by a busy-loop process (one per core by
default, started before the suite and killed after it, whatever happens), and the suite
runs in the order pytest-randomly draws from a seed: modules shuffled, then the tests in
each (fixtures of a wider scope stay grouped). Each run gets its own seed, printed before
it starts (`--seeds` replays them); the runs stop at the first failure, whose seed is
printed again with the command that replays it.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shlex
import subprocess
import sys
import time


def busy_loop() -> None:
    """Keep one core busy until killed."""
    while True:
        pass


def start_hogs(count: int) -> list[multiprocessing.Process]:
    hogs = [multiprocessing.Process(target=busy_loop, name=f"hog-{i}", daemon=True)
            for i in range(count)]
    for hog in hogs:
        hog.start()
    return hogs


def stop_hogs(hogs: list[multiprocessing.Process]) -> None:
    for hog in hogs:
        hog.kill()
    for hog in hogs:
        hog.join(10)


def draw_seeds(runs: int) -> list[int]:
    """``runs`` different seeds."""
    seeds: list[int] = []
    while len(seeds) < runs:
        seed = random.SystemRandom().randrange(1, 2**32)
        if seed not in seeds:
            seeds.append(seed)
    return seeds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="suite runs, each its own seed")
    parser.add_argument("--seeds", default="", help="comma-separated seeds to replay")
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 1,
                        help="busy-loop processes (default: one per core)")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER,
                        help="after --: passed to pytest")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s] or draw_seeds(args.runs)
    extra = [a for a in args.pytest_args if a != "--"]
    print(f"test-stress: {len(seeds)} run(s), seeds {', '.join(map(str, seeds))}; "
          f"{args.hogs} busy loop(s) on {os.cpu_count()} core(s)", flush=True)
    hogs = start_hogs(args.hogs)
    try:
        for n, seed in enumerate(seeds, 1):
            command = [sys.executable, "-m", "pytest", "-p", "randomly",
                       f"--randomly-seed={seed}", "--durations=15", *extra]
            print(f"\ntest-stress: run {n}/{len(seeds)}, seed {seed}: {shlex.join(command)}",
                  flush=True)
            started = time.monotonic()
            code = subprocess.call(command)
            took = time.monotonic() - started
            print(f"test-stress: run {n}/{len(seeds)}, seed {seed}: exit {code} in "
                  f"{took / 60:.1f} min", flush=True)
            if code != 0:
                print(f"test-stress: FAILED with seed {seed}; replay it with "
                      f"`make test-stress SEEDS={seed}`", flush=True)
                return code
    finally:
        stop_hogs(hogs)
    print(f"\ntest-stress: {len(seeds)} run(s) passed, seeds {', '.join(map(str, seeds))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
