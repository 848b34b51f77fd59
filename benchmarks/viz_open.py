"""How long /viz takes to show attention for an input of a few hundred tokens, in Chromium.

Usage (from the repository root, in the dev venv; Debian's chromium and playwright):
    # start `attnserve serve --model ARTIFACT` on --port for the run (stopped at the end)
    python -m benchmarks viz-open --model artifacts/smollm2-135m-instruct --tokens 300 \\
        --runs 3 -- --max-total-tokens 2048
    # or a server already running (the artifact still gives the tokenizer)
    python -m benchmarks viz-open --model artifacts/smollm2-135m-instruct \\
        --url http://127.0.0.1:8000

Each run opens the page in a fresh browser context, types the input (README.md prose cut
to --tokens tokens) and clicks "Show attention"; it reports, per run and as medians:
``open_ms``, from navigation to the head view drawn (the figure the 3-second target is
about); ``click_ms``, from the click to the head view drawn; ``model_view_ms``, from
switching to the model view until every layer's thumbnails are painted; and the bytes of
/attention responses the page received before it could draw. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.lib import serving
from service.artifact.text import TextCodec
from service.contract import io_spec as io

CHROMIUM = "/usr/bin/chromium"
READY = "#status[data-state=ready]"


def input_text(artifact: Path, tokens: int) -> tuple[str, int]:
    """README.md prose cut to ``tokens`` tokens of the artifact's tokenizer."""
    codec = TextCodec.from_file(artifact / io.TOKENIZER_FILE)
    ids = codec.encode(Path("README.md").read_text("utf-8"))[:tokens]
    text = codec.decode(ids)
    return text, len(codec.encode(text))


def one_run(browser: Any, url: str, text: str, legacy: bool) -> dict[str, float]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    sizes: list[int] = []
    page.on("response", lambda r: sizes.append(int(r.headers.get("content-length", 0)))
            if r.url.endswith("/attention") else None)
    started = time.perf_counter()
    page.goto(f"{url}/viz")
    page.wait_for_function("() => !document.getElementById('run').disabled")
    page.fill("#prompt", text)
    page.set_checked("#continue", False)
    clicked = time.perf_counter()
    page.click("#run")
    page.wait_for_selector(READY, timeout=120_000)
    if not legacy:
        page.wait_for_selector("#head-canvas[data-layer]", timeout=120_000)
    drawn = time.perf_counter()
    first_bytes = sum(sizes)
    layers, heads = page.evaluate("() => [window.attnviz.state.model.L, "
                                  "window.attnviz.state.model.H]")
    page.click("[data-view=model]")
    if legacy:  # the page before layer-by-layer loading paints every thumbnail at once
        page.wait_for_function(f"() => document.querySelectorAll('canvas.thumb').length "
                               f"=== {layers * heads}", timeout=300_000)
    else:
        page.wait_for_selector(f"#model-grid[data-loaded='{layers}']", timeout=300_000)
    filled = time.perf_counter()
    context.close()
    return {"open_ms": (drawn - started) * 1000, "click_ms": (drawn - clicked) * 1000,
            "model_view_ms": (filled - drawn) * 1000, "first_bytes": first_bytes,
            "all_bytes": sum(sizes)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks viz-open",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="artifact (tokenizer; "
                        "served for the run unless --url is given)")
    parser.add_argument("--url", help="a running server")
    parser.add_argument("--port", type=int, default=8160)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--legacy", action="store_true",
                        help="the page before layer-by-layer loading (for a before/after)")
    parser.add_argument("server_args", nargs="*", help="after --: more `attnserve serve` options")
    args = parser.parse_args(argv)
    if args.tokens < 2 or args.runs < 1:
        parser.error("--tokens must be at least 2 and --runs at least 1")
    from playwright.sync_api import sync_playwright

    text, count = input_text(args.model, args.tokens)
    url = args.url
    with contextlib.ExitStack() as stack:
        if url is None:
            url = stack.enter_context(serving.started(args.model, args.port, args.server_args,
                                                      "viz_open")).url
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
            runs = [one_run(browser, url, text, args.legacy) for _ in range(args.runs)]
            browser.close()
    medians = {k: round(statistics.median(r[k] for r in runs), 1) for k in runs[0]}
    print(json.dumps({"tokens": count, "runs": [{k: round(v, 1) for k, v in r.items()}
                                                for r in runs], "median": medians}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
