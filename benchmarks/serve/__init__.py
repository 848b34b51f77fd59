"""The serving benchmark (``python -m benchmarks serve``): vLLM ``bench serve``-style load
against a running server or one it starts, with Poisson arrivals, streaming requests and
the TTFT / TPOT / ITL / E2E / goodput report."""
