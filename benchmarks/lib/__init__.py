"""What the benchmarks share and a user never runs: the side-by-side harness, its workers,
runners and presets, the measurement loop, and the serving harness (benchmarks/lib/serving.py)
that every benchmark which starts a server goes through."""
