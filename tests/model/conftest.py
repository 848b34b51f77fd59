"""Fixtures for the model tests: small random GPTs whose logits are far from uniform."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from model.config import GPTConfig
from model.gpt import GPT


def make_model(seed: int = 0, std: float = 0.3, **overrides: object) -> GPT:
    """A random GPT with a wide init, so greedy choices are not near-ties of ~1e-6."""
    fields: dict[str, object] = dict(vocab_size=37, d_model=32, n_heads=4, n_layers=3,
                                     d_ff=64, max_seq_len=48)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**fields))  # type: ignore[arg-type]
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, std if "emb" in name or "head" in name else 0.15)
    return model.eval()


@pytest.fixture
def random_gpt() -> Callable[..., GPT]:
    return make_model

