"""The package arrows, checked statically: model ← export → contract ← service.

Every import statement in the source (module level and inside functions, since lazy
imports are still dependencies) is read with ``ast``; nothing is imported to check it.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("model", "export", "service", "benchmarks")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def imported_names(path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules ``path`` imports; ``from pkg import sub`` counts as pkg.sub when
    sub is a module."""
    out: set[str] = set()
    this = module_name(path)
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = this if path.name == "__init__.py" else this.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                out.add(candidate if candidate in modules else base)
    return {name for name in out if name.split(".")[0] in PACKAGES}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = source_modules()
    return {name: imported_names(path, modules) for name, path in modules.items()}


def violations(graph: dict[str, set[str]], package: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(f"{src} imports {dst}" for src, dsts in graph.items()
                  if src.split(".")[0] == package
                  for dst in dsts if dst.split(".")[0] in forbidden)


def test_service_imports_neither_model_nor_export(graph: dict[str, set[str]]) -> None:
    assert violations(graph, "service", ("model", "export", "benchmarks")) == []


def test_export_and_model_never_import_upwards(graph: dict[str, set[str]]) -> None:
    assert violations(graph, "model", ("export", "benchmarks")) == []
    model_uses_service = {dst for src, dsts in graph.items() if src.startswith("model")
                          for dst in dsts if dst.startswith("service")}
    # the head geometry it shares with the artifact config, the chat template rendering
    # the fine-tuner must share with the server (train/serve skew otherwise), and the PEFT
    # adapter format the fine-tuner writes and the server reads (one check of both)
    assert model_uses_service <= {"service.contract.heads", "service.contract.chat_template",
                                  "service.contract.peft_adapter"}, model_uses_service
    assert violations(graph, "export", ("benchmarks",)) == []
    export_uses_service = {dst for src, dsts in graph.items() if src.startswith("export")
                           for dst in dsts if dst.startswith("service")}
    # the contract, and the GGUF op library's locator (which the contract's sessions use)
    assert all(dst.startswith(("service.contract", "service.ops")) or dst == "service"
               for dst in export_uses_service), export_uses_service


def test_the_contract_stands_alone(graph: dict[str, set[str]]) -> None:
    """The contract is what export and service share: it imports only itself and the GGUF
    op library's locator (service/ops, a leaf: sessions register the op where a graph
    uses it)."""
    leaks = sorted(f"{src} imports {dst}" for src, dsts in graph.items()
                   if src.startswith("service.contract")
                   for dst in dsts
                   if not dst.startswith(("service.contract", "service.ops")) and dst != "service")
    assert leaks == []
    ops_leaks = sorted(f"{src} imports {dst}" for src, dsts in graph.items()
                       if src.startswith("service.ops")
                       for dst in dsts if dst.split(".")[0] in PACKAGES
                       and not dst.startswith("service.ops") and dst != "service")
    assert ops_leaks == []


def test_the_service_layers_depend_one_way(graph: dict[str, set[str]]) -> None:
    """Routes over the engine over the artifact: the engine never imports the HTTP layer,
    and reading an artifact needs neither."""
    def leaks(package: str, forbidden: tuple[str, ...]) -> list[str]:
        return sorted(f"{src} imports {dst}" for src, dsts in graph.items()
                      if src.startswith(package)
                      for dst in dsts if dst.startswith(forbidden))

    assert leaks("service.engine", ("service.http",)) == []
    assert leaks("service.artifact", ("service.engine", "service.http")) == []


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_find_cycle_sees_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_inside_a_package(graph: dict[str, set[str]], package: str) -> None:
    inside = {src: {d for d in dsts if d.split(".")[0] == package}
              for src, dsts in graph.items() if src.split(".")[0] == package}
    assert find_cycle(inside) is None


def test_nothing_reads_outside_the_repository() -> None:
    """No source, test or build file names the sibling reading-material directory."""
    sibling = "shared"
    needle = "/".join(("..", sibling))
    data_dir = f'"{sibling}" / '  # the pathlib spelling of the same thing
    hits = []
    for pattern in ("*.py", "Makefile", "*.sh", "*.toml", "*.yml", "*.yaml", "Dockerfile*"):
        for path in REPO.rglob(pattern):
            if ".venv" in path.parts or ".cache" in path.parts:
                continue
            text = path.read_text("utf-8", errors="replace")
            if needle in text or data_dir in text:
                hits.append(str(path.relative_to(REPO)))
    assert hits == []


@pytest.mark.slow
def test_wheel_ships_no_benchmark_or_test_code_and_serve_needs_no_torch(tmp_path: Path) -> None:
    """What `pip install '.[serve]'` installs: the wheel's files and its serve extra.

    Built from a copy of the tracked sources, so no stale build/ directory of the checkout
    can hide a file the package data would miss (and none is left in the checkout)."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                             check=True).stdout.decode().split("\0")
    source = tmp_path / "src"
    for rel in filter(None, tracked):
        if (REPO / rel).is_file():
            (source / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, source / rel)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path / "dist"), str(source)],
                   check=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("attnserve-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        metadata = next(zf.read(n).decode() for n in names if n.endswith("METADATA"))
    top = {n.split("/")[0] for n in names}
    assert {"model", "export", "service"} <= top
    static = {str(p.relative_to(REPO)) for p in (REPO / "service" / "static").rglob("*")
              if p.is_file()}  # the /viz page is package data
    assert static and static <= set(names), sorted(static - set(names))
    assert not top & {"benchmarks", "tests"}
    serve_requirements = [line for line in metadata.splitlines()
                          if line.startswith("Requires-Dist:") and 'extra == "serve"' in line]
    assert serve_requirements, metadata
    assert not [r for r in serve_requirements if "torch" in r or "attnserve[" in r]
