"""Start `attnserve serve` for the service tests.

Usage:
    [ATTNSERVE_TEST_STEP_DELAY=0.02] [ATTNSERVE_TEST_ATTENTION_GATE=DIR]
        python tests/service/launch_server.py serve --model DIR ...

With ATTNSERVE_TEST_STEP_DELAY set, every model forward pass sleeps that many seconds
first, so tests can act while a request is provably still decoding (cancellation, queue
limits, drain) without timing races. With ATTNSERVE_TEST_ATTENTION_GATE set to a directory
holding two FIFOs, ``entered`` and ``release``, every attention.onnx run of more than one
token (the warm-up runs one) first writes a byte to ``entered`` and then waits for a byte
on ``release``: the test knows exactly when a request is inside the attention session and
decides when it leaves. Nothing else changes: same CLI, same server.
"""

from __future__ import annotations

import os
import sys
import time


def main() -> int:
    delay = float(os.environ.get("ATTNSERVE_TEST_STEP_DELAY", "0"))
    if delay > 0:
        from service.engine.session import OnnxModel

        forward = OnnxModel.forward

        def slow_forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            time.sleep(delay)
            return forward(self, *args, **kwargs)

        OnnxModel.forward = slow_forward  # type: ignore[method-assign]
    gate = os.environ.get("ATTNSERVE_TEST_ATTENTION_GATE")
    if gate:
        from service.engine.session import AttentionModel

        run = AttentionModel.run

        def gated_run(self, token_ids, kinds):  # type: ignore[no-untyped-def]
            if len(token_ids) > 1:
                with open(os.path.join(gate, "entered"), "w") as entered:
                    entered.write("1")  # blocks until the test reads
                with open(os.path.join(gate, "release")) as release:
                    release.read(1)  # blocks until the test writes
            return run(self, token_ids, kinds)

        AttentionModel.run = gated_run  # type: ignore[method-assign]
    from service.cli import main as cli_main

    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
