"""The benchmarks' one front door: ``python -m benchmarks NAME [ARGS ...]``.

Usage (from the repository root, in the dev venv):
    python -m benchmarks --help                 # every benchmark and tool, one line each
    python -m benchmarks NAME --help            # one benchmark's own options
    python -m benchmarks sized-speed --gguf FILE --artifact DIR ...

NAME (``-`` or ``_`` alike) is a module benchmarks/NAME.py or a package benchmarks/NAME/, run
as ``python -m benchmarks.NAME ARGS`` runs it (that form still works). The list is read from
the folder, each line from the entry's docstring: a new benchmark is listed by being there;
benchmarks/lib/ holds what they share. Options and no NAME (``python -m benchmarks --presets
small``, as results/ records runs) are the side-by-side benchmark, as they always were.
"""

from __future__ import annotations

import ast
import pkgutil
import runpy
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Entries that make what a benchmark runs rather than measure anything.
TOOLS = ("llamacpp_env", "llamacpp_tools", "lora_adapters", "sized_presets")


def names() -> list[str]:
    """Every benchmark and tool in the folder, by module name (lib/ is no entry)."""
    return sorted(m.name for m in pkgutil.iter_modules([str(HERE)])
                  if m.name not in ("lib", "__main__"))


def source(name: str) -> Path:
    return HERE / name / "__main__.py" if (HERE / name).is_dir() else HERE / f"{name}.py"


def purpose(name: str) -> str:
    """The first paragraph of the entry's docstring on one line (parsed, not imported: most
    entries import torch or onnxruntime)."""
    doc = ast.get_docstring(ast.parse(source(name).read_text("utf-8"))) or ""
    return " ".join(doc.split("\n\n")[0].split())


def listing() -> str:
    lines = [__doc__.split("\n\n")[1] if __doc__ else ""]
    width = max(len(n) for n in names()) + 2
    for title, tools in (("benchmarks", False), ("tools", True)):
        lines += ["", f"{title}:"]
        for name in (n for n in names() if (n in TOOLS) == tools):
            text = textwrap.wrap(purpose(name), 94 - width, break_on_hyphens=False) or [""]
            lines.append(f"  {name.replace('_', '-'):<{width}}{text[0]}")
            lines += [" " * (width + 2) + more for more in text[1:]]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(listing())
        return 0
    name, rest = ("side_by_side", argv) if argv[0].startswith("-") else (argv[0], argv[1:])
    module = name.replace("-", "_")
    if module not in names():
        print(f"benchmarks: no benchmark {name!r} (`python -m benchmarks --help` lists them)",
              file=sys.stderr)
        return 2
    sys.argv = [str(source(module)), *rest]
    runpy.run_module(f"benchmarks.{module}", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
