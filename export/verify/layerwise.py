"""PyTorch's side of the export's checks for a model too large to hold in float32 at once.

:class:`export.verify.parity.TorchReference` decodes each check prompt greedily with PyTorch's
own KV cache, one token a forward over the whole model: it needs every weight in memory
(a 1B model's are 4.3 GB in float32, the 3B's 12 GB). :class:`LayerwiseReference`
answers the same questions (``logits``, ``greedy``, ``intermediates``) from the same
model, run layer-major: every check input is embedded, then each layer's weights are
dequantised from the checkpoint's GGUF file (model/gguf/reader.py ``HeldWeights``), every
input goes through that layer, and its weights are dropped before the next layer's come;
the LM head last. At most one layer (or the embedding) is in float32 at a time.

A layer-major pass cannot decode: the next token needs the whole model. So the greedy
continuations come from a graph under test that reads the file's weights exactly (the
level-0, float-activation rewrite of model.onnx, export/gguf/blocks.py), and PyTorch
recomputes the logits of every position of those sequences, teacher-forced, in one pass.
The checks then compare as before: logits within the float32 bound at every step, and
greedy choices equal wherever PyTorch's margin is clear (parity.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from export.verify.parity import CheckPrompts, TorchReference, left_pad
from model.gpt import GPT
from service.contract.pages import release_file_pages
from service.contract.reference import greedy


@dataclass
class _Pass:
    """One input of the layer-major pass: unpadded ids (B, T), or left-padded ones with
    their mask and positions; what it yields is kept under ``key``."""

    key: Any
    ids: torch.Tensor  # (B, T) int64
    mask: torch.Tensor | None = None  # (B, T)
    positions: torch.Tensor | None = None  # (B, T)
    introspect: bool = False
    intermediates: list[Any] = field(default_factory=list)


class LayerwiseReference(TorchReference):
    """TorchReference's answers, computed layer by layer (module docstring).

    ``gpt``: the model with its large weights on the meta device; ``held``: the source of
    their values (``Checkpoint.held``); ``decoder``: makes the graph whose greedy choices
    continue the decode and ragged prompts (OrtDecoder's call shape: model.onnx's, or
    engine.onnx's through export/verify/engine_parity.py's EngineDecoder). Everything is computed
    by :meth:`prepare`; a question it did not prepare raises.
    """

    def __init__(self, gpt: GPT, held: Any, decoder: Callable[[], Any]) -> None:
        super().__init__(gpt)
        self.held = held
        self.decoder = decoder

    def prepare(self, prompts: CheckPrompts) -> LayerwiseReference:
        continued = prompts.continued(self.gpt.config)
        dec = self.decoder()
        groups: dict[int, list[list[int]]] = {}  # steps → its prompts, decoded as one batch
        for p, n in continued:
            groups.setdefault(n, []).append(p)
        sequences = {(tuple(p), n): [*p, *chosen.tolist()] for n, group in groups.items()
                     for p, chosen in zip(group, greedy(dec, group, n), strict=True)}
        del dec
        passes = [_Pass(("logits", prompts.prefill.shape, prompts.prefill.tobytes()),
                        torch.from_numpy(prompts.prefill.astype(np.int64)))]
        passes += [_Pass(("greedy", key), torch.tensor([tokens[:-1]]))
                   for key, tokens in sequences.items()]
        ids, mask, pos = left_pad(prompts.attention)
        passes.append(_Pass(("intermediates", repr(prompts.attention)), torch.from_numpy(ids),
                            torch.from_numpy(mask), torch.from_numpy(pos), introspect=True))
        logits = self._run(passes)
        for one, out in zip(passes, logits, strict=True):
            kind, *key = one.key
            if kind == "logits":
                self._logits[self._logits_key(prompts.prefill)] = out.numpy()
            elif kind == "greedy":
                self._greedy[key[0]] = (sequences[key[0]], out[0].numpy())
            else:
                self._intermediates[repr(prompts.attention).encode()] = one.intermediates
        return self

    @torch.no_grad()
    def _run(self, passes: list[_Pass]) -> list[torch.Tensor]:
        """Each pass's logits (B, T, V), every layer's weights in memory once, in turn.
        The file's pages a layer was dequantised from go with its weights: the memory map
        would otherwise keep every layer's resident (the whole file by the LM head, 1.5 GB
        of a 3B export's 4.4 GB peak)."""
        gpt, held = self.gpt, self.held
        with held.filled(gpt, "tok_emb."):
            states = [gpt.embed(p.ids, p.mask, p.positions, 0) for p in passes]
        release_file_pages(held.path)
        for i in range(gpt.config.n_layers):
            with held.filled(gpt, f"blocks.{i}."):
                for j, (p, (x, context)) in enumerate(zip(passes, states, strict=True)):
                    x, _, inter = gpt.layer(i, x, context, None, p.introspect)
                    states[j] = (x, context)
                    if inter is not None:
                        p.intermediates.append(inter)
            release_file_pages(held.path)
        head = "tok_emb." if gpt.config.tie_weights else "lm_head."
        with held.filled(gpt, head):
            return [gpt.head(x) for x, _ in states]

    def logits(self, ids: np.ndarray) -> np.ndarray:
        return self._prepared(self._logits, self._logits_key(ids), "logits")

    def greedy(self, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
        return self._prepared(self._greedy, (tuple(prompt), steps), "greedy continuation")

    def intermediates(self, prompts: list[list[int]]) -> list[Any]:
        return self._prepared(self._intermediates, repr(prompts).encode(), "intermediates")

    @staticmethod
    def _prepared(cache: dict[Any, Any], key: Any, what: str) -> Any:
        if key not in cache:
            raise KeyError(f"LayerwiseReference: no {what} prepared for this input "
                           "(prepare() computes the check prompts' only)")
        return cache[key]
