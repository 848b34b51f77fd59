"""model/steering.py: the PyTorch reference of a steered forward, against the residual
stream computed by hand, block by block (GPT.embed / GPT.layer / GPT.head), with the
vector added where llama.cpp adds it (after block k, blocks counted from 0)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from model.config import config_from_preset
from model.gpt import GPT
from model.steering import block_outputs, steered, steering_layers

N_LAYERS = 4


@pytest.fixture(scope="module", params=["llama-tiny", "tiny"])
def model(request: pytest.FixtureRequest) -> GPT:
    config = replace(config_from_preset(request.param, vocab_size=50), n_layers=N_LAYERS)
    torch.manual_seed(0)
    gpt = GPT(config).eval()
    with torch.no_grad():
        for p in gpt.parameters():
            p.normal_(0, 0.3)
    return gpt


IDS = torch.tensor([[3, 14, 15, 9, 26, 5], [7, 7, 1, 40, 2, 11]])  # (B, T)


def by_hand(model: GPT, added: dict[int, np.ndarray]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every block's output and the logits, with ``added[k]`` summed onto block k's."""
    with torch.no_grad():
        x, context = model.embed(IDS, None, None, 0)
        outputs = []
        for i in range(N_LAYERS):
            x, _, _ = model.layer(i, x, context, None)
            if i in added:
                x = x + torch.from_numpy(added[i])  # (B, T, d) + (d,)
            outputs.append(x)
        return outputs, model.head(x)


def test_a_vector_at_one_layer_is_added_to_that_block_s_output(model):
    d = model.config.d_model
    direction = np.random.default_rng(0).standard_normal(d).astype(np.float32)
    with steered(model, {2: direction}, scale=1.5):
        outputs = block_outputs(model, IDS)
        with torch.no_grad():
            logits = model(IDS).logits
    expected, expected_logits = by_hand(model, {2: direction * np.float32(1.5)})
    for got, want in zip(outputs, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=1e-5)
    plain, plain_logits = by_hand(model, {})
    torch.testing.assert_close(outputs[1], plain[1], atol=0, rtol=0)  # before it: untouched
    assert (logits - plain_logits).abs().max() > 1e-2  # and it matters


def test_the_layer_range_and_scale_zero(model):
    d = model.config.d_model
    rng = np.random.default_rng(1)
    vector = {k: rng.standard_normal(d).astype(np.float32) for k in (1, 2, 3)}
    with torch.no_grad():
        plain = model(IDS).logits
        with steered(model, vector, scale=0.0):
            torch.testing.assert_close(model(IDS).logits, plain, atol=0, rtol=0)
        with steered(model, vector, scale=-2.0, layers=(2, 2)):
            ranged = model(IDS).logits
        torch.testing.assert_close(model(IDS).logits, plain, atol=0, rtol=0)  # hooks removed
    _, expected = by_hand(model, {2: vector[2] * np.float32(-2.0)})
    torch.testing.assert_close(ranged, expected, atol=1e-5, rtol=1e-5)


def test_llama_cpp_s_layer_rule():
    vector = dict.fromkeys((1, 2, 3), 0.0)
    assert steering_layers(vector, 4) == [1, 2, 3]  # llama.cpp's default range 1 … n_layers
    assert steering_layers(vector, 4, (2, 9)) == [2, 3]
    with pytest.raises(ValueError, match=r"layers \[0, 4\]: a model of 4 layers is steered "
                                         r"at layers 1 … 3"):
        steering_layers({0: 0.0, 2: 0.0, 4: 0.0}, 4)
