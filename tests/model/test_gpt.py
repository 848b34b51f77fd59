"""GPT parity and invariants: causality, KV cache, SDPA vs explicit, intermediates,
left padding, sinusoidal positions and the parameter count."""

from __future__ import annotations

import math

import pytest
import torch

from model.config import GPTConfig
from model.gpt import GPT
from model.sample import generate


def _ids(seed: int, shape: tuple[int, int], vocab: int = 37) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("explicit", [False, True])
def test_changing_a_later_token_never_changes_earlier_logits(random_gpt, explicit):
    model = random_gpt()
    x = _ids(1, (2, 20))
    base = model(x, return_intermediates=explicit).logits
    for j in (0, 7, 19):
        changed = x.clone()
        changed[:, j] = (changed[:, j] + 5) % 37
        logits = model(changed, return_intermediates=explicit).logits
        torch.testing.assert_close(logits[:, :j], base[:, :j], atol=1e-6, rtol=0)
        assert not torch.allclose(logits[:, j], base[:, j])  # the changed token does matter


@pytest.mark.parametrize("position", ["learned", "sinusoidal"])
def test_cached_decoding_equals_full_recomputation(random_gpt, position):
    model = random_gpt(position=position)
    x = _ids(2, (3, 24))
    full = model(x).logits  # (B, T, V)
    prefill = model(x[:, :10])
    pieces, past = [prefill.logits], prefill.present
    for t in range(10, 24):
        out = model(x[:, t:t + 1], past_key_values=past)
        assert out.present[0][0].shape == (3, 4, t + 1, 8)  # (B, nh, T_past + 1, hs)
        pieces.append(out.logits)
        past = out.present
    cached = torch.cat(pieces, dim=1)
    assert (cached - full).abs().max().item() <= 1e-4


def test_generate_with_cache_equals_recompute(random_gpt):
    model = random_gpt()
    prompt = _ids(3, (2, 5))
    for kwargs in ({"greedy": True}, {"temperature": 0.9, "top_k": 10, "top_p": 0.9, "seed": 7}):
        cached = generate(model, prompt, 25, use_cache=True, **kwargs)
        slow = generate(model, prompt, 25, use_cache=False, **kwargs)
        assert torch.equal(cached.sequences, slow.sequences)
        assert cached.sequences.shape == (2, 30)
        assert (cached.logits - slow.logits).abs().max().item() <= 1e-4
    # The recompute path's logits are literally a full forward over the final sequence.
    full = model(cached.sequences[:, :-1]).logits[:, 4:]
    assert (cached.logits - full).abs().max().item() <= 1e-4


def test_generate_stops_at_eos_and_respects_the_context(random_gpt):
    model = random_gpt()
    prompt = _ids(4, (1, 5))
    first = int(generate(model, prompt, 1, greedy=True).sequences[0, -1])
    out = generate(model, prompt, 20, greedy=True, eos_token_id=first)
    assert out.sequences.shape == (1, 6) and bool(out.finished[0])
    long = generate(model, prompt, 500, greedy=True)
    assert long.sequences.shape[1] == model.config.max_seq_len
    with pytest.raises(ValueError, match="temperature"):
        generate(model, prompt, 3, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, prompt, 3, top_p=1.5)


@pytest.mark.parametrize("tie", [False, True])
def test_sdpa_path_equals_explicit_path(random_gpt, tie):
    model = random_gpt(tie_weights=tie)
    x = _ids(5, (2, 16))
    fast, slow = model(x), model(x, return_intermediates=True)
    assert (fast.logits - slow.logits).abs().max().item() <= 1e-5
    mask = torch.ones_like(x)
    mask[0, :6] = 0  # left padding goes through the masked SDPA branch
    fast, slow = model(x, attention_mask=mask), model(x, attention_mask=mask,
                                                      return_intermediates=True)
    assert (fast.logits - slow.logits).abs().max().item() <= 1e-5
    past = model(x[:, :9]).present
    fast = model(x[:, 9:], past_key_values=past)
    slow = model(x[:, 9:], past_key_values=past, return_intermediates=True)
    assert (fast.logits - slow.logits).abs().max().item() <= 1e-5


def test_intermediates_have_documented_shapes_and_properties(random_gpt):
    model = random_gpt()
    b, t, nh, hs = 2, 11, 4, 8
    out = model(_ids(6, (b, t)), return_intermediates=True)
    assert out.intermediates is not None and len(out.intermediates) == model.config.n_layers
    upper = torch.ones(t, t, dtype=torch.bool).triu(diagonal=1)
    for layer in out.intermediates:
        for name in ("q", "k", "v"):
            assert getattr(layer, name).shape == (b, nh, t, hs)
        for name in ("scores", "scaled_scores", "weights"):
            assert getattr(layer, name).shape == (b, nh, t, t)
        torch.testing.assert_close(layer.scores, layer.q @ layer.k.transpose(-2, -1))
        torch.testing.assert_close(layer.scaled_scores[..., ~upper],
                                   (layer.scores / math.sqrt(hs))[..., ~upper])
        assert torch.isneginf(layer.scaled_scores[..., upper]).all()
        torch.testing.assert_close(layer.weights.sum(-1), torch.ones(b, nh, t))
        assert (layer.weights[..., upper] == 0).all()
        assert (layer.weights >= 0).all()
    # Decode step: one query row over past + 1 keys.
    past = model(_ids(6, (b, t))).present
    step = model(_ids(7, (b, 1)), past_key_values=past, return_intermediates=True)
    assert step.intermediates is not None
    assert step.intermediates[2].weights.shape == (b, nh, 1, t + 1)


def test_left_padded_batch_equals_each_prompt_alone(random_gpt):
    model = random_gpt()
    prompts = [_ids(8, (1, 4))[0], _ids(9, (1, 9))[0]]
    width = max(len(p) for p in prompts)
    batch = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        batch[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    logits = model(batch, attention_mask=mask).logits
    generated = generate(model, batch, 12, attention_mask=mask, greedy=True)
    for i, p in enumerate(prompts):
        alone = model(p[None]).logits[0]
        assert (logits[i, width - len(p):] - alone).abs().max().item() <= 1e-5
        alone_gen = generate(model, p[None], 12, greedy=True)
        assert torch.equal(generated.new_tokens(width)[i], alone_gen.new_tokens(len(p))[0])
        assert (generated.logits[i] - alone_gen.logits[0]).abs().max().item() <= 1e-4


def test_sinusoidal_encoding_matches_the_formula(random_gpt):
    d, length = 16, 48
    model = random_gpt(d_model=d, position="sinusoidal")
    expected = torch.zeros(length, d)
    for pos in range(length):
        for i in range(d // 2):
            angle = pos / (10000 ** (2 * i / d))
            expected[pos, 2 * i] = math.sin(angle)
            expected[pos, 2 * i + 1] = math.cos(angle)
    positions = model.positions(torch.arange(length)[None])[0]  # (T, d)
    torch.testing.assert_close(positions, expected, atol=1e-5, rtol=0)
    assert positions[0, 1].item() == 1.0 and positions[0, 0].item() == 0.0
    assert not any("pos" in name for name, _ in model.named_parameters())


@pytest.mark.parametrize("overrides", [
    {},
    {"tie_weights": True},
    {"position": "sinusoidal"},
    {"position": "sinusoidal", "tie_weights": True, "activation": "gelu"},
    {"attn_bias": True, "tie_weights": True, "activation": "gelu_tanh"},  # GPT-2's
    {"vocab_size": 4, "d_model": 512, "n_heads": 8, "n_layers": 6, "d_ff": 2048,
     "max_seq_len": 128},
])
def test_num_params_equals_closed_form(overrides):
    fields = {"vocab_size": 101, "d_model": 24, "n_heads": 3, "n_layers": 2, "d_ff": 40,
              "max_seq_len": 17} | overrides
    config = GPTConfig(**fields)
    model = GPT(config)
    assert model.num_params() == config.num_params_closed_form()
    assert model.num_params() == sum(p.numel() for p in {id(p): p for p in
                                                          model.parameters()}.values())


def test_closed_form_equals_a_hand_count():
    # vocab 10, d 8, 1 layer, d_ff 16, 6 positions, learned, untied:
    #   token embedding 10*8 = 80, position embedding 6*8 = 48
    #   block: W_q, W_k, W_v, W_o 4*8*8 = 256; FFN up 8*16+16 = 144, down 16*8+8 = 136;
    #          two LayerNorms 2*(8+8) = 32  -> 568
    #   final LayerNorm 8+8 = 16; LM head 10*8 = 80
    #   total 80 + 48 + 568 + 16 + 80 = 792; tied: 792 - 80 = 712; sinusoidal: 792 - 48 = 744
    config = GPTConfig(vocab_size=10, d_model=8, n_heads=2, n_layers=1, d_ff=16, max_seq_len=6)
    assert config.num_params_closed_form() == 792
    tied = GPTConfig(**(config.to_dict() | {"tie_weights": True}))
    assert tied.num_params_closed_form() == 712
    sinusoidal = GPTConfig(**(config.to_dict() | {"position": "sinusoidal"}))
    assert sinusoidal.num_params_closed_form() == 744
    assert GPT(config).num_params() == 792
    # GPT-2's attention biases: 4 projections * 8 = 32 more
    biased = GPTConfig(**(config.to_dict() | {"attn_bias": True}))
    assert biased.num_params_closed_form() == GPT(biased).num_params() == 824


def test_config_without_new_fields_loads_as_before():
    """A config.json written before attn_bias / gelu_tanh existed builds the same model."""
    old = {"vocab_size": 10, "d_model": 8, "n_heads": 2, "n_layers": 1, "d_ff": 16,
           "max_seq_len": 6, "dropout": 0.0, "position": "learned", "activation": "relu",
           "tie_weights": False, "layer_norm_eps": 1e-5}
    config = GPTConfig.from_dict(old)
    assert config.attn_bias is False
    names = set(GPT(config).state_dict())
    assert "blocks.0.attn.w_q.weight" in names and "blocks.0.attn.w_q.bias" not in names


def test_gelu_tanh_is_gpt2_gelu_new_and_last_logits_only_is_the_last_row(random_gpt):
    x = torch.linspace(-6, 6, 101)
    gelu_new = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    model = random_gpt(activation="gelu_tanh", attn_bias=True)
    assert (model.blocks[0].ffn.act(x) - gelu_new).abs().max().item() <= 1e-6
    ids = _ids(3, (2, 9))
    full = model(ids).logits
    last = model(ids, last_logits_only=True).logits
    assert last.shape == (2, 1, full.shape[-1])
    assert (last - full[:, -1:]).abs().max().item() <= 1e-6


def test_matmul_attention_impl_equals_sdpa_and_is_reversible(random_gpt):
    model = random_gpt()
    x = _ids(6, (2, 12))
    mask = torch.ones_like(x)
    mask[1, :4] = 0
    past = model(x[:, :7], attention_mask=mask[:, :7]).present
    reference = model(x[:, 7:], attention_mask=mask, past_key_values=past).logits
    model.set_attention_impl("matmul")
    assert not any(block.attn.use_sdpa for block in model.blocks)
    written_out = model(x[:, 7:], attention_mask=mask, past_key_values=past).logits
    assert (written_out - reference).abs().max().item() <= 1e-5
    model.set_attention_impl("sdpa")
    assert all(block.attn.use_sdpa for block in model.blocks)
    with pytest.raises(ValueError, match="unknown attention impl"):
        model.set_attention_impl("flash")  # type: ignore[arg-type]
