"""Start `attnserve serve` for the service tests, its model runner under the test's control.

Usage:
    [ATTNSERVE_TEST_GATE=FIFO] [ATTNSERVE_TEST_POISON=TOKEN_ID] \
        python tests/service/launch_server.py serve --model DIR ...

ATTNSERVE_TEST_GATE names a FIFO the test writes one-character commands to (see
fault_runner.py): every forward pass, the warm-up included, waits for "." (run) or "!"
(fail), or runs freely after "+" or once the test closes the FIFO. So a test acts while a
request is provably mid-decode, or fails exactly one pass, with no timing involved.
ATTNSERVE_TEST_POISON fails every prefill whose prompt holds that token id. Nothing else
changes: same CLI, same server.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def main() -> int:
    gate_path = os.environ.get("ATTNSERVE_TEST_GATE")
    poison = os.environ.get("ATTNSERVE_TEST_POISON")
    if gate_path or poison:
        from fault_runner import ControlledRunner, FifoGate  # beside this script

        import service.runtime as runtime

        create = runtime.create_model

        def controlled(*args: Any, **kwargs: Any) -> Any:
            return ControlledRunner(create(*args, **kwargs),
                                    FifoGate(gate_path) if gate_path else None,
                                    int(poison) if poison else None)

        runtime.create_model = controlled  # type: ignore[assignment]
    from service.cli import main as cli_main

    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
