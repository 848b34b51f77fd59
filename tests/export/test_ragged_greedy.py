"""The greedy loop (service/contract/reference.py) over prompts of different lengths in one
batch: right-padded, each row read at its own last token and continued at its own length,
through model.onnx (OrtDecoder) and the engine graphs (EngineDecoder, per-row cache
lengths). Each row must decode as the prompt does alone, and as PyTorch's own greedy loop
(model/sample.py) does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from export.verify.engine_parity import EngineDecoder
from model.checkpoint import load_checkpoint
from model.sample import generate
from service.contract import io_spec as io
from service.contract.engine_spec import ENGINE_FILE, ENGINE_MIXED_FILE
from service.contract.reference import OrtDecoder, greedy

PROMPTS = [[464, 2068, 7586, 21831, 18045, 625, 262, 16931], [40, 716, 257], [50, 51, 52, 53, 54]]
STEPS = 12


@pytest.mark.parametrize("graph", [io.MODEL_FILE, ENGINE_FILE, ENGINE_MIXED_FILE])
def test_prompts_of_different_lengths_decode_as_each_alone(graph: str, gpt2_artifact: Path,
                                                           gpt2_checkpoint: Path) -> None:
    gpt = load_checkpoint(gpt2_checkpoint).model
    vocab = gpt.config.vocab_size
    prompts = [[t % vocab for t in p] for p in PROMPTS]
    dec = (OrtDecoder.from_artifact(gpt2_artifact) if graph == io.MODEL_FILE
           else EngineDecoder(gpt2_artifact / graph, gpt))
    together = greedy(dec, prompts, STEPS)  # (3, STEPS)
    alone = np.concatenate([greedy(dec, [p], STEPS) for p in prompts])
    assert np.array_equal(together, alone)
    for p, row in zip(prompts, together, strict=True):
        with torch.no_grad():
            want = generate(gpt, torch.tensor([p]), STEPS, greedy=True).sequences[0, len(p):]
        assert row.tolist() == want.tolist()
