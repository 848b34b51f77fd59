"""`attnserve steer`: a control vector from contrastive prompt pairs, made as llama.cpp's
``llama-cvector-generator`` makes it (tools/cvector-generator/: cvector-generator.cpp,
mean.hpp, pca.hpp), written in its GGUF format (service/contract/control_vector.py).

Per pair, as cvector-generator does:

- both prompts are tokenized as written: special tokens in the text are read as such, BOS
  is prepended where the checkpoint's tokenizer prepends one, and no chat template is
  applied (cvector-generator applies none: its prompt files carry their own template
  tokens; so may ours);
- the shorter is padded at the end with the last token of " ";
- both run through the model, and at the output of every block but the last (llama.cpp's
  last ``l_out`` holds only the output row, so it never takes that one) the residual
  stream at every position is taken: positive − negative, a row per position;
- rows with no element above 1e-6 are dropped (llama.cpp's filter, one-sided as it is):
  a shared prefix gives equal hidden states and so no row.

Over all pairs' rows X (rows × d_model), per layer:

- ``mean``: the mean row, divided by its L2 norm;
- ``pca``: the unit eigenvector of the largest eigenvalue of XᵀX, uncentred, as
  cvector-generator's power iteration converges to it (computed here exactly, in float64,
  as X's first right singular vector).
  Its sign in llama.cpp is that of a random start (llama.cpp issue 8724); ours is fixed:
  the mean row projects on it positively, so a positive scale steers toward the positive
  prompts, as the mean method's direction does.

The rows at block i's output (0-based) become ``direction.<i+1>``: cvector-generator's
numbering, which llama.cpp then adds after block i+1. Both are llama.cpp's as they are, so
a vector made here equals the one cvector-generator makes on the same model and prompts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from service.contract.control_vector import ControlVector, write_control_vector

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from model.checkpoint import CheckpointMeta
    from model.gpt import GPT

Method = Literal["mean", "pca"]
METHODS: tuple[Method, ...] = ("mean", "pca")
ZERO_ROW = 1e-6  # cvector-generator's filter_nonzero_rows threshold


class SteerRefused(ValueError):
    """The pairs file or the checkpoint cannot make a control vector (one line, why)."""


@dataclass(frozen=True)
class Pair:
    line: int  # 1-based, in the pairs file
    positive: str
    negative: str


def read_pairs(path: str | os.PathLike[str]) -> list[Pair]:
    """``{"positive": str, "negative": str}`` per line (blank lines skipped, other keys
    ignored); every bad line is named, with its number, in one error."""
    path = Path(path)
    try:
        text = path.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SteerRefused(f"--pairs {path}: {exc}") from exc
    pairs: list[Pair] = []
    bad: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        problem = _problem(line)
        if problem:
            bad.append(f"{number} ({problem})")
            continue
        row = json.loads(line)
        pairs.append(Pair(number, row["positive"], row["negative"]))
    if bad:
        raise SteerRefused(f"--pairs {path}: bad line{'s' if len(bad) > 1 else ''} "
                           f"{', '.join(bad)}; each line is "
                           '{"positive": "...", "negative": "..."}')
    if not pairs:
        raise SteerRefused(f"--pairs {path} holds no pairs")
    return pairs


def _problem(line: str) -> str | None:
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return "not JSON"
    if not isinstance(row, dict):
        return "not an object"
    for key in ("positive", "negative"):
        if key not in row:
            return f"no {key!r}"
        if not isinstance(row[key], str) or not row[key]:
            return f"{key!r} is not a non-empty string"
    return None


def steer(ckpt_dir: str | os.PathLike[str], pairs_path: str | os.PathLike[str],
          out: str | os.PathLike[str], method: Method = "pca", force: bool = False) -> Path:
    """Check the arguments and the pairs, load the model, write the vector: nothing is
    written unless all of it succeeds."""
    out = Path(out)
    if method not in METHODS:
        raise SteerRefused(f"--method {method!r}: one of {', '.join(METHODS)}")
    if out.suffix != ".gguf":
        raise SteerRefused(f"--out {out}: a control vector's file name ends in .gguf")
    if out.exists() and not force:
        raise SteerRefused(f"{out} exists; pass --force to replace it")
    pairs = read_pairs(pairs_path)
    from model.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(ckpt_dir)
    if checkpoint.meta.model.n_layers < 2:
        raise SteerRefused(f"{ckpt_dir}: a model of one layer has no layer llama.cpp steers")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(checkpoint.tokenizer_path))
    rows = difference_rows(checkpoint.model, tokenizer, pairs)
    directions = {i + 1: reduce(x, method) for i, x in enumerate(rows)}
    return write_control_vector(ControlVector(directions, model_hint(checkpoint.meta)), out)


def difference_rows(model: GPT, tokenizer: Tokenizer, pairs: Sequence[Pair]
                    ) -> list[np.ndarray]:
    """Per block but the last: the kept positive − negative rows of all pairs, (rows, d)
    float32 (see the module docstring)."""
    import torch

    from model.steering import block_outputs

    pad = tokenizer.encode(" ", add_special_tokens=False).ids[-1]
    limit = model.config.max_seq_len
    n_kept = model.config.n_layers - 1
    kept: list[list[np.ndarray]] = [[] for _ in range(n_kept)]
    for pair in pairs:
        ids = [tokenizer.encode(text).ids for text in (pair.positive, pair.negative)]
        length = max(map(len, ids))
        if length > limit:
            raise SteerRefused(f"--pairs line {pair.line}: {length} tokens, more than the "
                               f"model's {limit}")
        batch = torch.tensor([row + [pad] * (length - len(row)) for row in ids])  # (2, T)
        outputs = block_outputs(model, batch)  # n_layers × (2, T, d)
        for layer in range(n_kept):
            diff = (outputs[layer][0] - outputs[layer][1]).float().numpy()  # (T, d)
            diff = diff[(diff > ZERO_ROW).any(axis=1)]
            if not len(diff):
                raise SteerRefused(f"--pairs line {pair.line}: the positive and negative "
                                   f"prompts differ nowhere at layer {layer + 1}")
            kept[layer].append(diff)
    return [np.concatenate(rows) for rows in kept]


def reduce(x: np.ndarray, method: Method) -> np.ndarray:
    """One unit direction (d,) float32 from the rows ``x`` (rows, d)."""
    rows = x.astype(np.float64)
    mean = rows.mean(axis=0)  # (d,)
    if method == "mean":
        direction = mean
    else:
        import torch

        # XᵀX's top eigenvector is X's first right singular vector: an SVD of the rows
        # (rows × d) costs less than an eigendecomposition of XᵀX (d × d) when rows < d.
        # torch's, on torch's threads: numpy's OpenBLAS starts a thread per core, and on
        # busy cores SmolLM2's 29 layers took 40-50 s that way, 0.3 s on one thread.
        direction = torch.linalg.svd(torch.from_numpy(rows), full_matrices=False
                                     ).Vh[0].numpy()  # (d,)
        if direction @ mean < 0:
            direction = -direction
    return (direction / np.linalg.norm(direction)).astype(np.float32)


def model_hint(meta: CheckpointMeta) -> str:
    """llama.cpp's name for the model's architecture (cvector-generator writes the GGUF
    model's ``general.architecture``), or our own where llama.cpp has none."""
    from export.gguf.layout import GGUFOutRefused
    from export.gguf.metadata import family_of, model_type

    try:
        return family_of(meta.model)
    except GGUFOutRefused:
        return model_type(meta.model)
