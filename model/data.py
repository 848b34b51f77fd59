"""Training corpora, tokenized streams, batching and the unigram baseline.

The default corpus, ``stdlib``, needs no download: it is the Python standard library's own
documentation — module, class and function docstrings read from the stdlib *source* files
with ``ast`` (never imported, so no module runs any code), cleaned with
``inspect.cleandoc``, with hard-wrapped prose paragraphs joined into single lines (code,
doctest and list blocks keep their lines), deduplicated and ordered by their sha256 so
that the order is deterministic and a tail split is a fair sample. It is built once and
cached as a text file whose documents are separated by a line holding only ``<end>``;
``--data FILE`` files use the same convention (a file without such lines is one document).

In the token stream every document is followed by the ``<end>`` token, so the model learns
where a document stops and generation can stop there too.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import math
import os
import re
import sys
import sysconfig
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

STDLIB = "stdlib"
DOC_SEPARATOR = "\n<end>\n"
VALIDATION_FRACTION = 0.1
MIN_DOC_CHARS = 60  # "Return self." and friends teach nothing

# Stdlib packages whose docstrings are GUI, test or tooling noise rather than API prose.
SKIPPED_PACKAGES = frozenset({
    "test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip",
    "site-packages", "dist-packages", "__pycache__", "pydoc_data", "config-3",
})


def cache_dir() -> Path:
    """$ATTNSERVE_CACHE_DIR, else $XDG_CACHE_HOME/attnserve, else ~/.cache/attnserve."""
    if env := os.environ.get("ATTNSERVE_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "attnserve"


def _is_public_module(rel: Path) -> bool:
    parts = rel.with_suffix("").parts
    if any(p in SKIPPED_PACKAGES or p.startswith("config-3") for p in parts):
        return False
    names = [p for p in parts if p != "__init__"]
    if any(n.startswith("_") or n.startswith("test") or "-" in n for n in names):
        return False
    return rel.name not in ("__main__.py", "this.py", "antigravity.py")


def _docstrings(tree: ast.Module) -> Iterator[str]:
    """Module docstring, then public classes, functions and methods in source order."""
    if doc := ast.get_docstring(tree, clean=True):
        yield doc
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            if node.name.startswith("_") and node.name != "__init__":
                continue
            if doc := ast.get_docstring(node, clean=True):
                yield doc


_STRUCTURED_LINE = re.compile(r"^(\s|>>>|\.\.\.|[-*+•|]\s|\d+[.)]\s|[A-Za-z_]\w*\s*--|:)")


def reflow(doc: str) -> str:
    """Join the hard-wrapped lines of each prose paragraph into one line.

    Docstrings wrap at ~72 columns, which makes a newline the most frequent token and
    teaches a small model to answer uncertainty with blank lines. Paragraphs with any
    indented, doctest, list or table line are left exactly as written.
    """
    paragraphs = re.split(r"\n\s*\n", doc)
    out = []
    for para in paragraphs:
        lines = para.split("\n")
        if len(lines) > 1 and not any(_STRUCTURED_LINE.match(line) for line in lines):
            para = " ".join(line.strip() for line in lines)
        out.append(para)
    return "\n\n".join(out)


def stdlib_documents(stdlib_dir: Path | None = None) -> list[str]:
    """Deduplicated docstrings of the public stdlib modules, ordered by sha256."""
    root = stdlib_dir or Path(sysconfig.get_paths()["stdlib"])
    unique: dict[str, str] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if not _is_public_module(rel):
            continue
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError, OSError):
            continue  # a few stdlib files are deliberately invalid (e.g. bad-encoding tests)
        for doc in _docstrings(tree):
            text = reflow(inspect.cleandoc(doc).strip())
            if len(text) < MIN_DOC_CHARS or "<end>" in text:
                continue
            unique.setdefault(hashlib.sha256(text.encode("utf-8")).hexdigest(), text)
    return [unique[key] for key in sorted(unique)]


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def stdlib_corpus_path() -> Path:
    """Path of the cached stdlib corpus, building it on first use (a few seconds)."""
    version = f"py{sys.version_info.major}.{sys.version_info.minor}"
    path = cache_dir() / f"stdlib-docstrings-v2-{version}.txt"
    if not path.is_file():
        write_text_atomic(path, DOC_SEPARATOR.join(stdlib_documents()) + "\n")
    return path


def resolve_data_path(data: str) -> Path:
    """``stdlib`` or a path to an existing, non-empty UTF-8 text file (checked cheaply)."""
    if data == STDLIB:
        return stdlib_corpus_path()
    path = Path(data)
    if not path.exists():
        raise FileNotFoundError(f"corpus file {path} does not exist")
    if not path.is_file():
        raise ValueError(f"corpus {path} is not a regular file")
    if path.stat().st_size == 0:
        raise ValueError(f"corpus file {path} is empty")
    return path


def read_documents(path: Path) -> list[str]:
    """Split a UTF-8 corpus into documents at lines holding only ``<end>``."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"corpus file {path} is not UTF-8 text ({exc.reason} at byte "
                         f"{exc.start})") from exc
    text = text.replace("\r\n", "\n")
    docs = [d.strip("\n") for d in f"\n{text}\n".split(DOC_SEPARATOR)]
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ValueError(f"corpus file {path} holds no text")
    return docs


def encode_documents(tokenizer: Tokenizer, docs: list[str], eos_id: int) -> list[int]:
    """One stream: doc₁ <end> doc₂ <end> …"""
    stream: list[int] = []
    for encoding in tokenizer.encode_batch(docs, add_special_tokens=False):
        stream.extend(encoding.ids)
        stream.append(eos_id)
    return stream


@dataclass
class TokenSplits:
    train: torch.Tensor  # (N_train,) int64
    val: torch.Tensor  # (N_val,) int64


def split_stream(stream: list[int], context: int,
                 val_fraction: float = VALIDATION_FRACTION) -> TokenSplits:
    """Tail split; both parts must hold at least one full window of ``context + 1`` tokens."""
    need = context + 1
    n_val = max(need, int(len(stream) * val_fraction))
    if len(stream) - n_val < need:
        raise ValueError(
            f"corpus too short: {len(stream)} tokens, but a context of {context} needs at "
            f"least {2 * need} (one window each for training and validation)")
    import torch

    ids = torch.tensor(stream, dtype=torch.long)
    return TokenSplits(train=ids[: len(stream) - n_val], val=ids[len(stream) - n_val:])


class BatchSampler:
    """Random contiguous windows; batch ``step`` is a pure function of (seed, rank, step).

    Reseeding per step costs nothing and makes a resumed run draw exactly the batches the
    uninterrupted run would have drawn, while different ranks draw different windows.
    """

    def __init__(self, data: torch.Tensor, context: int, batch_size: int, seed: int,
                 rank: int = 0) -> None:
        import torch

        if len(data) < context + 1:
            raise ValueError(f"{len(data)} tokens cannot fill a window of {context + 1}")
        self.data, self.context, self.batch_size = data, context, batch_size
        self.seed, self.rank = seed, rank
        self.generator = torch.Generator()

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        mixed = ((self.seed * 1_000_003 + self.rank) * 1_000_033 + step) % (2**63)
        self.generator.manual_seed(mixed)
        starts = torch.randint(0, len(self.data) - self.context, (self.batch_size,),
                               generator=self.generator)  # (B,)
        offsets = torch.arange(self.context + 1)  # (T + 1,)
        windows = self.data[starts[:, None] + offsets]  # (B, T + 1)
        return windows[:, :-1], windows[:, 1:]  # inputs (B, T), targets (B, T)


def eval_windows(data: torch.Tensor, context: int, max_tokens: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping validation windows from the start, at most ``max_tokens`` targets."""
    count = max(1, min((len(data) - 1) // context, max_tokens // context))
    x = data[: count * context].view(count, context)  # (W, T)
    y = data[1: count * context + 1].view(count, context)  # (W, T)
    return x, y


def unigram_cross_entropy(train: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> float:
    """Loss (nats/token) of a model that ignores context and predicts the training token
    frequencies (add-one smoothed so unseen tokens cost a finite amount).

    A trained model must beat this to show it learned anything beyond word frequencies.
    """
    counts = Counter(train.tolist())
    total = len(train) + vocab_size
    nll = sum(-math.log((counts.get(t, 0) + 1) / total) * n
              for t, n in Counter(targets.reshape(-1).tolist()).items())
    return nll / targets.numel()
