"""attnserve: the command line.

Usage:
    attnserve import --gguf model.gguf --out checkpoints/mine     # or --hf DIR
    attnserve train  --data stdlib --preset small --out checkpoints/demo
    attnserve sample --ckpt checkpoints/demo --prompt "Return the"
    attnserve export --ckpt checkpoints/mine --out artifacts/mine --engine-graph
    attnserve eval   --model artifacts/mine --data stdlib
    attnserve serve  --model artifacts/mine

Each package registers its own subcommands through the ``attnserve.commands`` entry-point
group (pyproject.toml), so this root knows no package but its own: the serving image,
which installs only ``attnserve[serve]``, still lists train/export and explains the missing
extra when they are run. Handlers import heavy libraries only when they run, so
`attnserve --help` and `attnserve serve` work where torch is absent.
Errors the user can fix (ValueError, OSError and their subclasses) print one line and
exit 2; set ATTNSERVE_DEBUG=1 to see the traceback instead.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from importlib.metadata import entry_points
from types import FrameType

# Entry points whose objects are register(subparsers) functions; none imports torch.
COMMAND_GROUP = "attnserve.commands"
COMMAND_ORDER = {"model": 0, "export": 1, "serve": 2}

Handler = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnserve",
        description="Import a model (GGUF or Hugging Face: GPT-2, Llama, Qwen2, Qwen3, "
                    "SmolLM3, Mistral, Phi-3, Gemma 3) or train a small GPT, fine-tune it "
                    "(LoRA or full), export it to ONNX with a KV cache, and serve it.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for entry in sorted(entry_points(group=COMMAND_GROUP), key=lambda e: COMMAND_ORDER.get(
            e.name, len(COMMAND_ORDER))):
        entry.load()(subparsers)
    return parser


def missing_extra_message(exc: ModuleNotFoundError, command: str) -> str:
    extra = {"torch": "train", "onnx": "export", "gguf": "train",
             "transformers": "dev", "matplotlib": "dev"}.get((exc.name or "").split(".")[0])
    hint = f" (pip install 'attnserve[{extra}]')" if extra else ""
    return f"`attnserve {command}` needs the Python package {exc.name!r}{hint}"


def _terminated(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """SIGTERM (docker stop, kill) unwinds like Ctrl-C, so a staged output directory is
    removed rather than left behind half-written; `serve` installs its own drain handler."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    try:
        with sigterm_unwinds():
            return handler(args)
    except KeyboardInterrupt:
        print(f"attnserve {args.command}: interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as exc:
        if os.environ.get("ATTNSERVE_DEBUG"):
            raise
        print(f"attnserve {args.command}: error: {missing_extra_message(exc, args.command)}",
              file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:
        if os.environ.get("ATTNSERVE_DEBUG"):
            raise
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"attnserve {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
