"""Serve an artifact and ask it the demo's questions: `make finetune-demo`'s last step.

Usage (from the repository root):
    python -m model.finetune.demo.ask --model artifacts/smollm2-demo [--port 8000] [--exit]

Starts `attnserve serve` on the artifact, waits until /ready answers 200, asks every question
of heldout.jsonl (paraphrases of the fine-tuned facts that training never saw) and
general.jsonl (what the model knew before) through /v1/chat/completions, greedy, and
prints each answer with whether it holds the expected word; then keeps serving until
Ctrl-C (``--exit``: stops the server and exits 1 unless every answer was right).
Standard library only: this is a client.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
QUESTION_FILES = ("heldout.jsonl", "general.jsonl")
START_TIMEOUT_S = 300.0


def questions(name: str) -> list[dict[str, str]]:
    lines = (HERE / name).read_text("utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def served_model(base: str) -> str:
    with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as response:
        return str(json.load(response)["data"][0]["id"])


def ask(base: str, model: str, question: str) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": question}],
                       "max_tokens": 48, "temperature": 0}).encode()
    request = urllib.request.Request(f"{base}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return str(json.load(response)["choices"][0]["message"]["content"])


def wait_ready(base: str, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with status {server.returncode}")
        try:
            with urllib.request.urlopen(f"{base}/ready", timeout=5):
                return  # 200: loaded and warmed up (503 while loading)
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)  # a poll of another process's port, bounded by the deadline
    raise SystemExit(f"the server was not ready ({base}/ready) in {START_TIMEOUT_S:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the artifact to serve")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--exit", action="store_true",
                        help="stop after asking; exit 1 unless every answer was right")
    args = parser.parse_args()
    base = f"http://{args.host}:{args.port}"
    attnserve = Path(sys.executable).parent / "attnserve"
    server = subprocess.Popen([str(attnserve), "serve", "--model", args.model, "--host",
                               args.host, "--port", str(args.port), "--max-total-tokens",
                               "4096"])
    try:
        wait_ready(base, server)
        model = served_model(base)
        right = total = 0
        for name in QUESTION_FILES:
            print(f"\n{name}:")
            for item in questions(name):
                answer = ask(base, model, item["question"])
                ok = item["expect"].lower() in answer.lower()
                right, total = right + ok, total + 1
                print(f"  [{'right' if ok else 'WRONG'}] {item['question']}\n      {answer}")
        print(f"\n{right} of {total} answers hold the expected word.")
        if args.exit:
            return 0 if right == total else 1
        print(f"Serving {args.model} on {base} (Ctrl-C stops it).")
        server.wait()
        return server.returncode
    finally:
        if server.poll() is None:
            server.terminate()
            server.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
