"""Perplexity and bits per byte of an ONNX artifact or a PyTorch checkpoint on a text.

The rule is Hugging Face's sliding-window perplexity: windows of ``window`` tokens start
every ``stride`` tokens, and each window scores only the tokens the previous window did
not, with the tokens before them in the window as context. With ``stride < window`` every
token but the first is scored exactly once; each window is a fresh sequence (positions
from 0, no past), so the artifact needs one forward per window.

Both backends run the very same windows over the very same token ids (the artifact's
tokenizer.json is the checkpoint's), so their figures compare directly: fp32 against
int8, or an artifact against the checkpoint it was exported from. No beginning-of-sequence
token is prepended, for any model or backend: the text is scored as one continuous
stream, the same ids everywhere, whatever a tokenizer_config.json says about add_bos_token.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

DEFAULT_MAX_TOKENS = 4096
DEFAULT_WINDOW = 512  # or the model's context, when shorter
HELD_OUT_FRACTION = 0.1  # the tail of the stdlib corpus that training validates on
ENCODE_MARGIN = 64  # tokens past the cut of a partly encoded text, so the cut moves no kept id

Logits = Callable[[np.ndarray], np.ndarray]  # ids (T,) int64 → logits (T, V) float32


@dataclass(frozen=True)
class Window:
    begin: int  # first token fed
    end: int  # one past the last token fed
    scored: int  # first token scored: tokens scored..end-1, each from the tokens before it


def plan_windows(n_tokens: int, window: int, stride: int) -> list[Window]:
    """Hugging Face's windows: start every ``stride``; score what the last one left.

    A window's first token has no context in it, so with ``stride == window`` that token
    goes unscored, as in transformers' recipe; a window left with nothing to score is
    dropped.
    """
    windows: list[Window] = []
    prev_end = 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + window, n_tokens)
        scored = max(prev_end, begin + 1)
        if scored < end:
            windows.append(Window(begin, end, scored))
        prev_end = end
        if end == n_tokens:
            break
    return windows


def resolve_window(window: int | None, stride: int | None,
                   context: int) -> tuple[int, int]:
    """The defaults (min(context, 512), half of it) and the checks on given values."""
    window = min(context, DEFAULT_WINDOW) if window is None else window
    if window < 2:
        raise ValueError(f"--window must be at least 2 tokens, got {window}")
    if window > context:
        raise ValueError(f"--window {window} exceeds the model's context of {context} tokens")
    stride = max(1, window // 2) if stride is None else stride
    if not 1 <= stride <= window:
        raise ValueError(f"--stride must be between 1 and the window ({window}), got {stride}")
    return window, stride


def load_text(data: str) -> tuple[str, str]:
    """The text to score and how the result names it; ``data`` is a file or ``stdlib``.

    Documents (split at ``<end>`` lines, as training reads a corpus) are joined by a blank
    line, so the text is plain prose to every tokenizer. ``stdlib`` is scored on the
    documents that start in its last 10%, the tail training holds out, so a model trained
    on the corpus is not scored on text it learnt.
    """
    from model.data import STDLIB, read_documents, resolve_data_path

    docs = read_documents(resolve_data_path(data))
    if data != STDLIB:
        return "\n\n".join(docs), data
    cut = sum(map(len, docs)) * (1 - HELD_OUT_FRACTION)
    starts = np.cumsum([0] + [len(d) for d in docs[:-1]])
    held = [d for d, start in zip(docs, starts, strict=True) if start >= cut]
    return "\n\n".join(held), "stdlib (documents in its last 10%)"


def encode_prefix(tokenizer: Any, text: str, max_tokens: int) -> tuple[np.ndarray, int]:
    """The first ``max_tokens`` ids of ``text`` (no special tokens) and the UTF-8 bytes of
    the text they cover.

    Only a prefix of a long text is encoded, doubled until it holds a margin of tokens past
    ``max_tokens``: pre-tokenisation is local, so ids that far from the cut are final.
    """
    chars = max(1024, 8 * max_tokens)
    while True:
        enc = tokenizer.encode(text[:chars], add_special_tokens=False)
        if chars >= len(text) or len(enc.ids) > max_tokens + ENCODE_MARGIN:
            break
        chars *= 2
    n = min(max_tokens, len(enc.ids))
    if n < 2:
        raise ValueError(f"the text holds {len(enc.ids)} token(s); perplexity needs at "
                         "least 2")
    n_bytes = len(text[:enc.offsets[n - 1][1]].encode("utf-8"))
    return np.asarray(enc.ids[:n], np.int64), n_bytes


def window_nll(logits: np.ndarray, ids: np.ndarray, w: Window) -> float:
    """Summed negative log-likelihood (nats) of the tokens ``w`` scores, in float64."""
    rows = logits[w.scored - w.begin - 1:w.end - w.begin - 1].astype(np.float64)  # (S, V)
    rows -= rows.max(-1, keepdims=True)
    logp = rows - np.log(np.exp(rows).sum(-1, keepdims=True))  # (S, V)
    return float(-logp[np.arange(len(rows)), ids[w.scored:w.end]].sum())


@dataclass(frozen=True)
class Backend:
    """What is known before any weight is loaded, and how to load them."""

    name: Literal["onnx", "torch"]
    path: str
    tokenizer_file: Path
    context: int  # max_seq_len
    quantization: str | None
    open: Callable[[int], Logits]  # intra-op threads → the model's logits function


def artifact_backend(path: str) -> Backend:
    """model.onnx through the contract names: one forward per window, an empty past."""
    from service.contract import io_spec as io

    root = Path(path)
    if not (root / io.MODEL_FILE).is_file():
        raise FileNotFoundError(f"artifact {path} has no {io.MODEL_FILE}")
    config = io.ArtifactConfig.load(root)
    manifest = root / io.MANIFEST_FILE
    quantization = (json.loads(manifest.read_text("utf-8")).get("quantization")
                    if manifest.is_file() else None)

    def open_(threads: int) -> Logits:
        from service.contract.reference import OrtDecoder

        dec = OrtDecoder.from_artifact(root, threads=threads)

        def logits(ids: np.ndarray) -> np.ndarray:
            x = ids[None, :]  # (1, T)
            pos = np.arange(x.shape[1], dtype=np.int64)[None, :]  # (1, T)
            out, _ = dec(x, np.ones_like(x), pos, dec.empty_past(1))  # (1, T, V)
            return out[0]

        return logits

    return Backend("onnx", path, root / io.TOKENIZER_FILE, config.max_seq_len, quantization,
                   open_)


def checkpoint_backend(path: str) -> Backend:
    """The checkpoint's GPT in PyTorch (no_grad); torch's thread count is the caller's."""
    from model.checkpoint import TOKENIZER_FILE, read_meta

    meta = read_meta(path)

    def open_(threads: int) -> Logits:
        import torch

        from model.checkpoint import load_checkpoint

        gpt = load_checkpoint(path).model

        def logits(ids: np.ndarray) -> np.ndarray:
            with torch.no_grad():
                return gpt(torch.from_numpy(ids)[None, :]).logits[0].float().numpy()  # (T, V)

        return logits

    return Backend("torch", path, Path(path) / TOKENIZER_FILE, meta.model.max_seq_len, None,
                   open_)


def evaluate(backend: Backend, text: str, source: str, *,
             max_tokens: int = DEFAULT_MAX_TOKENS, window: int | None = None,
             stride: int | None = None, threads: int = 1,
             progress: bool = False) -> dict[str, Any]:
    """Score the first ``max_tokens`` tokens of ``text``; the result JSON as a dict."""
    from tokenizers import Tokenizer
    from tqdm import tqdm

    window, stride = resolve_window(window, stride, backend.context)
    if max_tokens < 2:
        raise ValueError(f"--max-tokens must be at least 2, got {max_tokens}")
    ids, n_bytes = encode_prefix(Tokenizer.from_file(str(backend.tokenizer_file)), text,
                                 max_tokens)
    windows = plan_windows(len(ids), window, stride)
    logits = backend.open(threads)
    scored = sum(w.end - w.scored for w in windows)
    started = time.perf_counter()
    nll = 0.0
    with tqdm(total=scored, unit="tok", desc=f"eval {backend.name}", file=sys.stderr,
              disable=not progress) as bar:
        for w in windows:
            nll += window_nll(logits(ids[w.begin:w.end]), ids, w)
            bar.update(w.end - w.scored)
    return {
        "model": backend.path, "backend": backend.name,
        "quantization": backend.quantization, "data": source,
        "tokens_scored": scored, "bytes": n_bytes, "nll_sum": nll,
        "perplexity": math.exp(nll / scored), "bits_per_byte": nll / math.log(2) / n_bytes,
        "window": window, "stride": stride,
        "seconds": round(time.perf_counter() - started, 3),
    }
