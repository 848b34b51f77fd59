"""Side-by-side benchmark: our engine against what users would pick instead.

Every engine runs in its own worker process (so its peak RSS is its own) on the same
weights, the same prompts and the same number of threads; the orchestrating process only
prepares the models, starts the workers and writes the report.
"""
