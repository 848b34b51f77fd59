"""Start `attnserve serve` for the service tests, its model runner under the test's control.

Usage:
    [ATTNSERVE_TEST_GATE=FIFO] [ATTNSERVE_TEST_POISON=TOKEN_ID] \
        [ATTNSERVE_TEST_ATTENTION_GATE=DIR] [ATTNSERVE_TEST_PORT_FILE=FILE] \
        python tests/service/launch_server.py serve --model DIR ...

ATTNSERVE_TEST_GATE names a FIFO the test writes one-character commands to (see
fault_runner.py): every forward pass, the warm-up included, waits for "." (run) or "!"
(fail), or runs freely after "+" or once the test closes the FIFO. So a test acts while a
request is provably mid-decode, or fails exactly one pass, with no timing involved.
ATTNSERVE_TEST_POISON fails every prefill whose prompt holds that token id.
ATTNSERVE_TEST_ATTENTION_GATE names a directory holding two FIFOs, ``entered`` and
``release``: every attention.onnx run of more than one token (the warm-up runs one) first
writes a byte to ``entered`` and then waits for a byte on ``release``, so the test knows
exactly when a request is inside the attention session and decides when it leaves.
ATTNSERVE_TEST_PORT_FILE names a file the port the server listens on is written to once it
is bound (atomically: the file appears whole): started with ``--port 0``, the server binds
a port the kernel picks, so no other process can take it between a test choosing it and
the server binding it.
Nothing else changes: same CLI, same server.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any


def main() -> int:
    gate_path = os.environ.get("ATTNSERVE_TEST_GATE")
    poison = os.environ.get("ATTNSERVE_TEST_POISON")
    if gate_path or poison:
        from fault_runner import ControlledRunner, FifoGate  # beside this script

        import service.engine.engine as engine

        create = engine.create_runner

        def controlled(*args: Any, **kwargs: Any) -> Any:
            return ControlledRunner(create(*args, **kwargs),
                                    FifoGate(gate_path) if gate_path else None,
                                    int(poison) if poison else None)

        engine.create_runner = controlled
    attention_gate = os.environ.get("ATTNSERVE_TEST_ATTENTION_GATE")
    if attention_gate:
        from service.viz.attention_model import AttentionModel

        run = AttentionModel.run

        def gated_run(self: Any, token_ids: Any, kinds: Any, layers: Any = None,
                      **options: Any) -> Any:
            if len(token_ids) > 1:
                with open(os.path.join(attention_gate, "entered"), "w") as entered:
                    entered.write("1")  # blocks until the test reads
                with open(os.path.join(attention_gate, "release")) as release:
                    release.read(1)  # blocks until the test writes
            return run(self, token_ids, kinds, layers, **options)

        AttentionModel.run = gated_run  # type: ignore[method-assign]
    port_file = os.environ.get("ATTNSERVE_TEST_PORT_FILE")
    if port_file:
        report_bound_port(port_file)
    from service.cli import main as cli_main

    return cli_main(sys.argv[1:])


def report_bound_port(path: str) -> None:
    """benchmarks/lib/bound_port.py's, loaded by its path: this script runs with the service
    importable, not the repository root."""
    where = Path(__file__).resolve().parents[2] / "benchmarks" / "lib" / "bound_port.py"
    spec = importlib.util.spec_from_file_location("attnserve_bound_port", where)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.report_bound_port(path)


if __name__ == "__main__":
    sys.exit(main())
