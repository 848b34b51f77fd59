"""Service test helpers: the greedy reference loop, real server subprocesses, their step
gate, and metric reading; imported by tests and by tests/service/conftest.py's fixtures.

Every server runs `attnserve serve` in a subprocess whose PYTHONPATH starts with a
directory holding a `torch.py` that raises ModuleNotFoundError, so each HTTP test also
proves the service never imports torch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from benchmarks.lib.bound_port import wait_bound_port, wait_ready
from service.artifact.text import TextCodec
from service.contract import io_spec as io
from service.contract.graphs import GraphTable
from service.contract.manifest import describe_files, load_manifest
from service.contract.reference import OrtDecoder, greedy_until
from service.engine.batch import Batch
from service.engine.request import GenerationRequest, TokenEvent
from service.engine.runner import ModelRunner
from service.engine.step import step_alone
from tests.step_failures import watch_server_log

HERE = Path(__file__).resolve().parent
NO_TORCH = HERE / "no_torch"
LAUNCHER = HERE / "launch_server.py"


def record_graphs(artifact: Path) -> Path:
    """List the graph files a test added to an exported ``artifact`` in its manifest, with
    its table of graphs, as export would have (else the engine serves the table's)."""
    manifest = load_manifest(artifact)
    names = sorted(p.name for p in artifact.iterdir()
                   if p.is_file() and p.name != io.MANIFEST_FILE)
    manifest.files = describe_files(artifact, names)
    manifest.graphs = GraphTable.of_files(names, manifest.kv_dtype, 0, 1).to_list()
    manifest.write(artifact)
    return artifact


def greedy_loop(artifact: Path) -> Callable[[list[int], int], list[int]]:
    """The greedy reference (service/contract/reference.py) over any artifact's model.onnx:
    batch 1, model.onnx by the contract's names, the past fed back every step, argmax; it
    shares no code with the engine. Stops at max_new tokens or right after the
    end-of-sequence token, like the engine."""
    config = io.ArtifactConfig.load(artifact)
    decoder = OrtDecoder.from_artifact(artifact)
    return lambda prompt, max_new: greedy_until(decoder, prompt, max_new, config.eos_token_id)


class GateWriter:
    """The test's end of a server's step gate (see fault_runner.py): a FIFO of commands.

    Opened read-write so opening never blocks; closing it opens the server's gate for good.
    """

    def __init__(self, path: Path) -> None:
        os.mkfifo(path)
        self.path = path
        self._fd: int | None = os.open(path, os.O_RDWR)

    def send(self, commands: str) -> None:
        assert self._fd is not None, "the gate is closed"
        os.write(self._fd, commands.encode("ascii"))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class ServerProcess:
    """`attnserve serve` in a subprocess on a loopback port, torch hidden.

    The server binds port 0 and the launcher reports the port the kernel gave it: a port
    picked here and bound there later could be taken by another process in between.
    ``port`` and ``url`` wait (bounded) for that report.

    With ``gate``, every forward pass of the server waits for the test's command (the
    warm-up's too): ``server.gate.send("+")`` lets it run freely, "-" holds it again.
    """

    def __init__(self, artifact: Path, log_path: Path, args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, gate: bool = False) -> None:
        self._port: int | None = None
        self.port_file = log_path.with_name(f"{log_path.name}.port")
        self.port_file.unlink(missing_ok=True)
        self.log_path = log_path
        environment = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSERVE_")}
        environment.update(env or {})
        self.gate: GateWriter | None = None
        if gate:
            self.gate = GateWriter(log_path.parent / "gate.fifo")
            environment["ATTNSERVE_TEST_GATE"] = str(self.gate.path)
        environment["PYTHONPATH"] = os.pathsep.join(
            [str(NO_TORCH), *filter(None, [os.environ.get("PYTHONPATH")])])
        environment["ATTNSERVE_TEST_PORT_FILE"] = str(self.port_file)
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, str(LAUNCHER), "serve", "--model", str(artifact),
             "--port", "0", "--intra-op-threads", "1", *args],
            env=environment, stdout=self._log, stderr=subprocess.STDOUT)
        watch_server_log(log_path, lambda: self.proc.poll() is None)

    @property
    def port(self) -> int:
        """The port the server listens on, once it has bound one (waits up to 120 s)."""
        if self._port is None:
            self._port = wait_bound_port(self.proc, self.port_file, 120.0, self.log_path)
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text("utf-8", errors="replace")

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        try:
            if self._port is None:
                self._port = wait_bound_port(self.proc, self.port_file, timeout, self.log_path)
            wait_ready(self.url, self.proc, max(0.0, deadline - time.monotonic()),
                       self.log_path, interval=0.1)
        except RuntimeError as exc:
            raise AssertionError(str(exc)) from None

    def stop(self) -> int:
        if self.gate is not None:
            self.gate.close()  # whatever waits at the gate runs on, so the drain ends
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def serving(artifact: Path, log_path: Path, args: tuple[str, ...] = (),
            env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """A ready server for a fixture to ``yield from``; stopped however the tests end."""
    proc = ServerProcess(artifact, log_path, args, env)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def gated_serving(artifact: Path, log_path: Path, args: tuple[str, ...] = (),
                  env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """As :func:`serving`, behind a step gate left open ("+") until a test holds it."""
    proc = ServerProcess(artifact, log_path, args, env, gate=True)
    try:
        assert proc.gate is not None
        proc.gate.send("+")
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def one_step(runner: ModelRunner, batch: Batch) -> list[TokenEvent]:
    """One step of ``batch`` on its own (its prefill, then decode steps): each row's token."""
    events = step_alone(runner, batch)
    assert all(len(row) == 1 for row in events)
    return [row[0] for row in events]


def run_with_joins(model: ModelRunner, codec: TextCodec, waves: list[list[GenerationRequest]],
                   join_every: int) -> dict[int, list[int]]:
    """Decode, adding one wave of requests every `join_every` steps; tokens by request id.

    Finished rows leave at once, so the batch is filtered and concatenated as it would be
    in the engine; any ModelRunner (model.onnx or engine.onnx, both over a KV pool) can be
    driven.
    """
    tokens: dict[int, list[int]] = {}
    batch: Batch | None = None
    step = 0
    while waves or batch is not None:
        if waves and step % join_every == 0:
            fresh = Batch.from_requests(waves.pop(0), codec, model.vocab_size)
            for seq, event in zip(fresh.sequences, one_step(model, fresh), strict=True):
                tokens.setdefault(seq.request.id, []).append(event.token.id)
            batch = fresh if batch is None else Batch.concatenate([batch, fresh], model)
        else:
            assert batch is not None
            for seq, event in zip(batch.sequences, one_step(model, batch), strict=True):
                tokens.setdefault(seq.request.id, []).append(event.token.id)
        assert batch is not None
        keep = [i for i, s in enumerate(batch.sequences) if s.finish is None]
        if keep:
            batch.filter(keep, model)
        else:
            batch.release(model)
            batch = None
        step += 1
    return tokens


def first_sse(lines: Iterator[str]) -> dict[str, Any]:
    """The first server-sent event of a stream, parsed."""
    for line in lines:
        if line.startswith("data:"):
            return dict(json.loads(line[5:]))
    raise AssertionError("stream ended before its first event")


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """One sample from a Prometheus exposition (0.0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in (labels or {}).items()):
                return float(sample.value)
    return 0.0


def wait_metric(server: ServerProcess, name: str, value: float, timeout: float = 20.0) -> None:
    """Until the server's /metrics shows ``name == value`` (bounded): how a test knows where
    requests are (running, waiting) while the gate holds the engine."""
    deadline = time.monotonic() + timeout
    while metric_value(text := httpx.get(f"{server.url}/metrics").text, name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}:\n{text}"
        time.sleep(0.02)


def write_peft_adapter(directory: Path, widths: dict[str, tuple[int, int]], rank: int = 2,
                       b_value: float = 0.0, **config: Any) -> Path:
    """A PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors) over
    modules of ``widths`` (transformers' name → (in, out)): A filled with 0.01, B with
    ``b_value`` (0: PEFT's initialisation, the adapter changes nothing); ``config`` adds
    or replaces LoraConfig fields."""
    import numpy as np
    from safetensors.numpy import save_file

    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": rank, "bias": "none",
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in widths}), **config}), "utf-8")
    tensors = {}
    for module, (width_in, width_out) in widths.items():
        key = f"base_model.model.{module}"
        tensors[f"{key}.lora_A.weight"] = np.full((rank, width_in), 0.01, np.float32)
        tensors[f"{key}.lora_B.weight"] = np.full((width_out, rank), b_value, np.float32)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


def without_steer(artifact: Path, out: Path, graph_file: str) -> Path:
    """A copy of ``artifact`` at ``out`` whose ``graph_file`` predates control vectors:
    ``steer`` no longer an input (its default a constant), the manifest's hash updated."""
    import shutil

    import onnx

    from service.contract.manifest import FileEntry, sha256_file

    shutil.copytree(artifact, out)
    graph = out / graph_file
    model = onnx.load(str(graph), load_external_data=False)
    kept = [i for i in model.graph.input if i.name != io.STEER]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    onnx.save(model, str(graph))
    manifest = load_manifest(out)
    manifest.files[graph_file] = FileEntry(sha256_file(graph), graph.stat().st_size)
    manifest.write(out)
    return out
