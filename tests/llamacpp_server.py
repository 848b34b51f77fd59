"""llama.cpp's own llama-server on a GGUF file, for the tests that compare against it.

Skips the calling test, with the reason, where the tools are not built (CI builds none:
`python -m benchmarks.llamacpp_tools --build` builds them). Bound to 127.0.0.1; the wait for
readiness polls /health with a deadline.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    def __init__(self, url: str) -> None:
        self.url = url

    def greedy(self, ids: list[int], n: int) -> list[int]:
        """llama.cpp's greedy continuation of the token ids: up to n tokens, ending with its
        end-of-generation token where it stops at one."""
        import httpx

        answer = httpx.post(f"{self.url}/completion", timeout=120, json={
            "prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1,
            "return_tokens": True, "cache_prompt": False}).json()
        return list(answer["tokens"])

    def tokenize(self, text: str) -> list[int]:
        import httpx

        return list(httpx.post(f"{self.url}/tokenize", timeout=30,
                               json={"content": text, "add_special": False}).json()["tokens"])


@contextmanager
def llama_server(model: Path, lora: Path | None = None, log: Path | None = None,
                 args: Sequence[str] = ()) -> Iterator[LlamaServer]:
    """``args``: more of llama-server's options (e.g. --control-vector-scaled FILE:SCALE)."""
    from benchmarks.lib.bound_port import wait_ready
    from benchmarks.llamacpp_tools import tool_path

    try:
        binary = tool_path("llama-server")
    except FileNotFoundError as exc:  # not built on this machine
        pytest.skip(str(exc))
    port = _free_port()
    argv = [str(binary), "-m", str(model), "--port", str(port), "--host", "127.0.0.1",
            "-c", "512", "-t", "1", "--no-warmup"]
    if lora is not None:
        argv += ["--lora", str(lora)]
    argv += list(args)
    out = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, 120.0, log=log, interval=0.1,
                   probe="/health")
        yield LlamaServer(f"http://127.0.0.1:{port}")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if log is not None:
            out.close()  # type: ignore[union-attr]

