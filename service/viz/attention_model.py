"""attention.onnx for the /attention dump and the /viz page: every layer's Q, K, V, scores,
scaled scores and weights for one sequence.

Kept apart from the decode runners (service/engine): it runs rarely, on its own session,
below the decode loop's priority (service/offload.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from service.contract import io_spec as io


class AttentionModel:
    """attention.onnx: every layer's Q, K, V, scores, scaled scores and weights."""

    def __init__(self, session: ort.InferenceSession, config: io.ArtifactConfig) -> None:
        self.session = session
        self.config = config
        self._outputs = io.attention_output_names(config.n_layers)
        available = {o.name for o in session.get_outputs()}
        missing = sorted(set(self._outputs) - available)
        if missing:
            raise ValueError(f"attention.onnx lacks outputs {missing[:4]}...")

    def run(self, token_ids: Sequence[int], kinds: Sequence[str]) -> dict[str, np.ndarray]:
        """{kind: (layers, heads, T, T or hs)} for one sequence, in the layout bertviz uses."""
        ids = np.asarray([token_ids], dtype=np.int64)  # (1, T)
        feeds = {io.INPUT_IDS: ids, io.ATTENTION_MASK: np.ones_like(ids),
                 io.POSITION_IDS: np.arange(ids.shape[1], dtype=np.int64)[None, :]}
        names = [io.attention_output_name(i, k) for k in kinds
                 for i in range(self.config.n_layers)]
        values = self.session.run(names, feeds)  # each (1, nh, T, T or hs)
        n = self.config.n_layers
        return {k: np.concatenate(values[j * n:(j + 1) * n], axis=0)  # (layers, nh, T, ...)
                for j, k in enumerate(kinds)}
