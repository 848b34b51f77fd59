"""Seed 000 reproduced with the project's GPT: learn the cycle 你→好→世→界→你.

The vocabulary is exactly the seed's four characters (ids 0..3, no special tokens, so the
model's vocab_size is 4 as in the seed); the model is the seed's configuration (d_model
512, 8 heads, 6 layers, d_ff 2048, learned positions for 128 tokens) trained with plain
Adam at the seed's learning rate 1e-4 on the single sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model.config import GPTConfig
from model.gpt import GPT

CHARS = ["你", "好", "世", "界"]
MAX_STEPS = 300


def test_seed_000_hello_world_cycle():
    char_to_id = {c: i for i, c in enumerate(CHARS)}
    x = torch.tensor([[char_to_id[c] for c in "你好世界"]])  # (1, 4)
    y = torch.tensor([[char_to_id[c] for c in "好世界你"]])  # (1, 4)

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=len(CHARS), d_model=512, n_heads=8, n_layers=6, d_ff=2048,
                       max_seq_len=128)
    model = GPT(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model.train()
    loss_value = float("inf")
    for _ in range(MAX_STEPS):
        logits = model(x).logits  # (1, 4, 4)
        loss = F.cross_entropy(logits.view(-1, len(CHARS)), y.view(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss_value = loss.item()
        if loss_value < 1e-3:
            break
    assert loss_value < 1e-3, f"loss still {loss_value} after {MAX_STEPS} steps"

    model.eval()
    with torch.no_grad():
        out = model(x, return_intermediates=True)
    prediction = [CHARS[i] for i in out.logits.argmax(-1)[0].tolist()]
    assert prediction == ["好", "世", "界", "你"]
    # What the seed prints for layer 0, here for every layer: causal weights over 4 tokens.
    assert out.intermediates is not None and len(out.intermediates) == 6
    for layer in out.intermediates:
        assert layer.weights.shape == (1, 8, 4, 4)
        assert (layer.weights.triu(diagonal=1) == 0).all()
