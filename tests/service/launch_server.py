"""Start `attnserve serve` for the service tests.

Usage:
    [ATTNSERVE_TEST_STEP_DELAY=0.02] python tests/service/launch_server.py serve --model DIR ...

With ATTNSERVE_TEST_STEP_DELAY set, every model forward pass sleeps that many seconds
first, so tests can act while a request is provably still decoding (cancellation, queue
limits, drain) without timing races. Nothing else changes: same CLI, same server.
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
    from service.cli import main as cli_main

    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
