"""The harness every serving benchmark shares: a server started for the run and stopped
after (on a port it binds itself and reports through benchmarks/lib/bound_port.py, so no
other process can take it in between), what a benchmark reads of it (its model, /info,
/metrics, memory), the options that start it, and the one JSON result printed and written.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks.lib.bound_port import LAUNCHER, http_get, wait_bound_port, wait_ready
from benchmarks.lib.measure import proc_memory_bytes, proc_memory_mb
from model.data import write_text_atomic
from service.contract.peft_adapter import read_config


class Server:
    """`attnserve serve --model ARTIFACT ...` in a subprocess on a loopback port, its output
    in ``log_path``."""

    def __init__(self, artifact: Path, env: dict[str, str], log_path: Path, port: int = 0,
                 args: Sequence[str] = ()) -> None:
        self._port: int | None = None
        self.port_file = log_path.with_name(f"{log_path.name}.port")
        self.port_file.unlink(missing_ok=True)
        self.log_path = log_path
        self.log = log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(LAUNCHER), str(self.port_file), "serve", "--model",
             str(artifact), "--host", "127.0.0.1", "--port", str(port), *args],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        """Its address, once it has bound a port (waits up to 180 s)."""
        if self._port is None:
            self._port = wait_bound_port(self.proc, self.port_file, 180.0, self.log_path)
        return f"http://127.0.0.1:{self._port}"

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        self._port = self._port or wait_bound_port(self.proc, self.port_file, timeout,
                                                   self.log_path)
        wait_ready(self.url, self.proc, max(0.0, deadline - time.monotonic()), self.log_path)

    def __enter__(self) -> Server:
        """Once ready (stopped if it never gets there)."""
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def peak_rss_mb(self) -> float | None:
        return proc_memory_mb(self.proc.pid).get("VmHWM")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def load_env(threads: int, env: dict[str, str]) -> dict[str, str]:
    """A load benchmark's server environment: a batch of 32 and warning logs unless ``env``
    says otherwise, and always ``threads`` ONNX Runtime threads."""
    return {"ATTNSERVE_MAX_BATCH_SIZE": "32", "ATTNSERVE_LOG_LEVEL": "warning", **env,
            "ATTNSERVE_INTRA_OP_THREADS": str(threads)}


@contextlib.contextmanager
def started(model: Path, port: int, server_args: Sequence[str], prog: str,
            timeout: float = 300.0) -> Iterator[Server]:
    """`attnserve serve --model MODEL --port PORT ...` for the length of a run, once ready
    (stopped at the end); a server that never gets ready exits the benchmark with one line,
    ``prog: why``."""
    log_path = Path(tempfile.mkdtemp(prefix="attnserve-bench-")) / "server.log"
    server = Server(model, dict(os.environ), log_path, port, server_args)
    try:
        try:
            server.wait_ready(timeout)
        except RuntimeError as exc:
            raise SystemExit(f"{prog}: {str(exc).splitlines()[0]}") from None
        yield server
    finally:
        server.stop()


def add_server_options(parser: argparse.ArgumentParser, port: int) -> None:
    """--port of the server a benchmark starts, --out for its JSON, and the `attnserve serve`
    options after ``--``."""
    parser.add_argument("--port", type=int, default=port)
    parser.add_argument("--out", type=Path)
    parser.add_argument("server_args", nargs="*", help="after --: more `attnserve serve` options")


def served_model(url: str) -> str:
    """The model a server serves (the first of its /v1/models): requests name it."""
    try:
        return str(json.loads(http_get(f"{url}/v1/models")[0])["data"][0]["id"])
    except OSError as exc:  # refused, timed out, an error status
        raise RuntimeError(f"{url}/v1/models: {getattr(exc, 'reason', exc)}") from None


def server_info(url: str) -> dict[str, Any]:
    """The server's /info, {} where it has none (llama-server)."""
    try:
        return dict(json.loads(http_get(f"{url}/info")[0]))
    except (OSError, ValueError):
        return {}


def metric(text: str, name: str) -> float | None:
    """The value of ``name`` in a /metrics page (its first series), None when absent."""
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def output_throughput(result_dir: Path) -> float:
    """Output tokens/s of one finished ``benchmarks serve`` run: its newest result file in
    ``result_dir`` (its ``--result-dir``)."""
    result = sorted(result_dir.glob("*.json"))[-1]
    return float(json.loads(result.read_text())["output_throughput"])


def memory(pid: int) -> dict[str, int]:
    """Bytes of VmRSS, RssAnon and RssFile of process ``pid`` (/proc/PID/status)."""
    got = proc_memory_bytes(pid)
    return {k: got[k] for k in ("VmRSS", "RssAnon", "RssFile") if k in got}


def mib(n: float, digits: int = 1) -> float:
    return round(n / 2**20, digits)


def breakdown(pid: int) -> dict[str, float]:
    """The server's anonymous and file-backed resident memory, in MiB."""
    now = memory(pid)
    return {f"{k}_mb": mib(now[k]) for k in ("RssAnon", "RssFile")}


async def for_duration(duration: float, sample: Callable[[], Awaitable[None]],
                       clients: Callable[[float], list[Awaitable[None]]]) -> float:
    """Run the ``clients(deadline)`` coroutines to a deadline ``duration`` seconds away,
    ``sample`` once a second meanwhile (peaks of RSS, of gauges), then give the engine a
    second for its last step and frees. Returns the seconds the clients ran."""
    stop = asyncio.Event()

    async def sampling() -> None:
        while not stop.is_set():
            await sample()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)

    sampler = asyncio.create_task(sampling())
    started = time.monotonic()
    await asyncio.gather(*clients(started + duration))
    elapsed = time.monotonic() - started
    stop.set()
    await sampler
    await asyncio.sleep(1.0)
    return elapsed


def emit(result: dict[str, Any], out: Path | None, ensure_ascii: bool = True) -> None:
    """Print the run's one JSON object; write it to ``out`` (atomically) when given."""
    text = json.dumps(result, indent=2, ensure_ascii=ensure_ascii)
    print(text)
    if out is not None:
        write_text_atomic(out, text + "\n")


def add_adapter_options(parser: argparse.ArgumentParser, what: str = "adapters") -> None:
    """--adapters-dir and the adapters under it a LoRA benchmark serves."""
    parser.add_argument("--adapters-dir", type=Path, required=True,
                        help="directory holding the adapters (the server's --lora-dir)")
    parser.add_argument(f"--{what}", type=lambda s: [n for n in s.split(",") if n],
                        default=["lora0", "lora1", "lora2", "lora3"],
                        help="adapters under --adapters-dir, comma-separated "
                             "(default lora0,lora1,lora2,lora3)")


def max_rank(directory: Path, names: Sequence[str]) -> int:
    """The largest LoRA rank r of the named adapters: the server's --max-lora-rank."""
    return max(read_config(directory / n).rank for n in names)


def lora_modules(directory: Path, names: Sequence[str]) -> list[str]:
    """``NAME=DIR`` of each named adapter, as `attnserve serve --lora-modules` takes them."""
    return [f"{n}={directory / n}" for n in names]
