"""model/finetune/lora.py and the families' lora_targets: names, outputs and merges.

Targets are checked against transformers' module names written out here and against the
layers our model has; adapted layers against ``W·x + b + s·B[rows]·A·x`` computed by hand
from the layer's weights and the LoRA's A and B (s = alpha / r, or alpha / √r with
rsLoRA); merged weights against W + s·B·A by hand, and a model loaded with them against
the adapted model's logits.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from torch import nn

from model.config import GPTConfig, config_from_preset
from model.finetune.lora import (
    AdaptedLinear,
    LoRASettings,
    attach,
    merged_weights,
    targets_of,
    wire,
)
from model.gpt import GPT
from tests.conftest import torch_threads

LLAMA_KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices gain nothing from threads; on a shared 2-core box they contend."""
    with torch_threads(1):
        yield


def small_gpt(seed: int = 0, **overrides) -> GPT:
    """A random GPT-2-style model with biases everywhere, in eval mode."""
    fields = dict(vocab_size=37, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_seq_len=16,
                  attn_bias=True)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**fields))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
            elif name.endswith("bias"):  # nonzero, so that a dropped bias shows
                p.uniform_(-0.1, 0.1)
            else:  # LayerNorm scales
                p.uniform_(0.9, 1.1)
    return model.eval()


def small_llama(fused: bool = False) -> GPT:
    """A random Llama with grouped K/V (Q 64 rows, K and V 32 each), optionally Phi-3's
    fused projections."""
    config = dataclasses.replace(config_from_preset("llama-tiny", vocab_size=41), d_ff=48,
                                 fused_projections=fused)
    torch.manual_seed(1)
    model = GPT(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    return model.eval()


def randomise_lora(adapter, seed: int = 5) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lora in adapter.each():
            lora.lora_A.copy_(torch.randn(lora.lora_A.shape, generator=gen))
            lora.lora_B.copy_(torch.randn(lora.lora_B.shape, generator=gen) * 0.3)


def set_mode(model: nn.Module, adapter, training: bool) -> None:
    """Both: the LoRAs belong to the adapter, not to the model (see the module's note)."""
    model.train(training)
    adapter.train(training)


# -- targets ---------------------------------------------------------------------------------
def test_llama_targets_are_transformers_names_over_our_layers() -> None:
    config = config_from_preset("llama-tiny")
    targets = targets_of(config)
    theirs = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    ours = ["attn.w_q", "attn.w_k", "attn.w_v", "attn.w_o", "ffn.gate", "ffn.up", "ffn.down"]
    assert [(t.module, t.ours, t.conv1d) for t in targets] == [
        (f"model.layers.{i}.{a}", (f"blocks.{i}.{b}",), False)
        for i in range(config.n_layers) for a, b in zip(theirs, ours, strict=True)]
    assert [t.kind for t in targets[:7]] == list(LLAMA_KINDS)
    model = GPT(config)
    for t in targets:  # every name is a linear layer of ours
        assert all(isinstance(model.get_submodule(name), nn.Linear) for name in t.ours)


def test_phi3_targets_fuse_qkv_and_gate_up() -> None:
    config = dataclasses.replace(config_from_preset("llama-tiny"), fused_projections=True)
    targets = targets_of(config)
    assert [(t.module, t.ours) for t in targets] == [
        item for i in range(config.n_layers) for item in (
            (f"model.layers.{i}.self_attn.qkv_proj",
             (f"blocks.{i}.attn.w_q", f"blocks.{i}.attn.w_k", f"blocks.{i}.attn.w_v")),
            (f"model.layers.{i}.self_attn.o_proj", (f"blocks.{i}.attn.w_o",)),
            (f"model.layers.{i}.mlp.gate_up_proj", (f"blocks.{i}.ffn.gate", f"blocks.{i}.ffn.up")),
            (f"model.layers.{i}.mlp.down_proj", (f"blocks.{i}.ffn.down",)))]
    assert {t.kind for t in targets} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}


def test_gpt2_targets_are_conv1d() -> None:
    config = config_from_preset("tiny")
    targets = targets_of(config)
    assert [(t.module, t.ours, t.conv1d) for t in targets] == [
        item for i in range(config.n_layers) for item in (
            (f"transformer.h.{i}.attn.c_attn",
             (f"blocks.{i}.attn.w_q", f"blocks.{i}.attn.w_k", f"blocks.{i}.attn.w_v"), True),
            (f"transformer.h.{i}.attn.c_proj", (f"blocks.{i}.attn.w_o",), True),
            (f"transformer.h.{i}.mlp.c_fc", (f"blocks.{i}.ffn.up",), True),
            (f"transformer.h.{i}.mlp.c_proj", (f"blocks.{i}.ffn.down",), True))]
    # PEFT's target_modules kinds: c_proj names two modules a layer
    assert [t.kind for t in targets_of(config, ("c_proj",))] == ["c_proj"] * 4


def test_kinds_select_targets_and_unknown_ones_are_refused() -> None:
    config = config_from_preset("llama-tiny")
    picked = targets_of(config, ("v_proj", "q_proj"))
    assert [t.module for t in picked] == [f"model.layers.{i}.self_attn.{k}"
                                          for i in range(2) for k in ("q_proj", "v_proj")]
    with pytest.raises(ValueError, match="c_attn") as info:
        targets_of(config, ("q_proj", "c_attn"))
    assert all(kind in str(info.value) for kind in LLAMA_KINDS)  # names the known ones
    with pytest.raises(ValueError, match="q_proj"):
        targets_of(config_from_preset("tiny"), ("q_proj",))


# -- attach: outputs ---------------------------------------------------------------------------
def test_fresh_adapter_leaves_the_logits_unchanged() -> None:
    base = small_gpt()
    model = copy.deepcopy(base)
    adapter = attach(model, LoRASettings(rank=4, alpha=8.0, dropout=0.0), seed=0)
    for lora in adapter.each():  # PEFT's init: B zero, A Kaiming-uniform (bound 1/√in)
        assert torch.equal(lora.lora_B, torch.zeros_like(lora.lora_B))
        a = lora.lora_A.detach()
        assert float(a.abs().max()) <= 1 / math.sqrt(a.shape[1])
        assert float(a.std()) > 0.2 / math.sqrt(a.shape[1])
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, base(ids).logits)


def adapted_layers(model: nn.Module) -> dict[str, AdaptedLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, AdaptedLinear)}


@pytest.mark.parametrize("rslora", [False, True])
def test_each_adapted_layer_adds_its_rows_of_the_update(rslora: bool) -> None:
    base = small_gpt()
    model = copy.deepcopy(base)
    settings = LoRASettings(rank=4, alpha=6.0, dropout=0.3, rslora=rslora)
    adapter = attach(model, settings, seed=0)
    randomise_lora(adapter)
    set_mode(model, adapter, False)
    s = 6.0 / 2.0 if rslora else 6.0 / 4.0  # alpha/√r, alpha/r
    # GPT-2: c_attn's A shared by w_q, w_k, w_v, its B rows 0-31, 32-63, 64-95
    loras = {lora.target.module: lora for lora in adapter.each()}
    assert len(loras) == 4 * 2
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(9))
    layers = adapted_layers(model)
    assert len(layers) == 6 * 2
    for i in range(2):
        fused = loras[f"transformer.h.{i}.attn.c_attn"]
        assert fused.lora_A.shape == (4, 32) and fused.lora_B.shape == (96, 4)
        parts = [(f"blocks.{i}.attn.w_{p}", fused, slice(32 * j, 32 * (j + 1)))
                 for j, p in enumerate("qkv")]
        parts += [(f"blocks.{i}.attn.w_o", loras[f"transformer.h.{i}.attn.c_proj"], slice(0, 32)),
                  (f"blocks.{i}.ffn.up", loras[f"transformer.h.{i}.mlp.c_fc"], slice(0, 64))]
        for name, lora, rows in parts:
            plain = base.get_submodule(name)
            a, b = lora.lora_A.detach(), lora.lora_B.detach()[rows]
            want = x @ plain.weight.T + plain.bias + s * (x @ a.T) @ b.T
            with torch.no_grad():
                got = layers[name](x)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        down = f"blocks.{i}.ffn.down"
        h = torch.randn(4, 64)
        lora, plain = loras[f"transformer.h.{i}.mlp.c_proj"], base.get_submodule(down)
        want = h @ plain.weight.T + plain.bias + s * (h @ lora.lora_A.T) @ lora.lora_B.T
        with torch.no_grad():
            torch.testing.assert_close(layers[down](h), want.detach(), rtol=1e-5, atol=1e-5)


def test_phi3_fused_rows_follow_the_layers_widths() -> None:
    """Q | K | V of unequal widths (64, 32, 32) and gate | up (48, 48) cut one B."""
    base = small_llama(fused=True)
    model = copy.deepcopy(base)
    adapter = attach(model, LoRASettings(rank=2, alpha=4.0, dropout=0.0), seed=3)
    randomise_lora(adapter)
    loras = {lora.target.module: lora for lora in adapter.each()}
    layers = adapted_layers(model)
    x = torch.randn(2, 64)
    cuts = {"self_attn.qkv_proj": (("attn.w_q", 0, 64), ("attn.w_k", 64, 96),
                                   ("attn.w_v", 96, 128)),
            "mlp.gate_up_proj": (("ffn.gate", 0, 48), ("ffn.up", 48, 96))}
    for module, parts in cuts.items():
        lora = loras[f"model.layers.1.{module}"]
        assert lora.lora_B.shape == (parts[-1][2], 2)
        for name, start, stop in parts:
            plain = base.get_submodule(f"blocks.1.{name}")
            b = lora.lora_B.detach()[start:stop]
            want = x @ plain.weight.T + 2.0 * (x @ lora.lora_A.detach().T) @ b.T
            with torch.no_grad():
                torch.testing.assert_close(layers[f"blocks.1.{name}"](x), want,
                                           rtol=1e-5, atol=1e-5)


def test_selected_kinds_adapt_only_those_layers() -> None:
    model = small_gpt()
    adapter = attach(model, LoRASettings(rank=2, targets=("c_fc",)), seed=0)
    assert sorted(adapted_layers(model)) == ["blocks.0.ffn.up", "blocks.1.ffn.up"]
    assert isinstance(model.get_submodule("blocks.0.attn.w_q"), nn.Linear)
    assert len(list(adapter.parameters())) == 2 * 2  # A and B of each
    with pytest.raises(ValueError, match="adapted already"):
        wire(model, adapter)


# -- attach: the seed -------------------------------------------------------------------------
def a_of(seed: int, global_seed: int) -> list[torch.Tensor]:
    torch.manual_seed(global_seed)
    adapter = attach(small_gpt(), LoRASettings(rank=4), seed=seed)
    return [lora.lora_A.detach().clone() for lora in adapter.each()]


def test_a_is_a_function_of_the_seed_alone() -> None:
    one = a_of(7, global_seed=100)
    same = a_of(7, global_seed=200)  # whatever the global generator's state
    other = a_of(8, global_seed=100)
    assert all(torch.equal(x, y) for x, y in zip(one, same, strict=True))
    assert not any(torch.equal(x, y) for x, y in zip(one, other, strict=True))
    assert not torch.equal(one[0], one[4])  # layers differ from one another


def test_attach_leaves_the_global_generator_alone() -> None:
    model = small_gpt()
    torch.manual_seed(1234)
    before = torch.random.get_rng_state()
    attach(model, LoRASettings(rank=4), seed=99)
    assert torch.equal(torch.random.get_rng_state(), before)


# -- merge ------------------------------------------------------------------------------------
def test_merged_weights_are_w_plus_s_b_a() -> None:
    base = small_gpt()
    model = copy.deepcopy(base)
    adapter = attach(model, LoRASettings(rank=3, alpha=5.0, dropout=0.1), seed=1)
    randomise_lora(adapter)
    merged = merged_weights(base, adapter)
    s = 5.0 / 3.0
    expected_names = {f"blocks.{i}.{n}.weight" for i in range(2)
                      for n in ("attn.w_q", "attn.w_k", "attn.w_v", "attn.w_o", "ffn.up",
                                "ffn.down")}
    assert set(merged) == expected_names
    loras = {lora.target.module: lora for lora in adapter.each()}
    for i in range(2):
        fused = loras[f"transformer.h.{i}.attn.c_attn"]
        for j, p in enumerate("qkv"):
            name = f"blocks.{i}.attn.w_{p}.weight"
            b = fused.lora_B.detach()[32 * j:32 * (j + 1)]
            want = base.get_parameter(name).detach() + s * b @ fused.lora_A.detach()
            torch.testing.assert_close(merged[name], want, rtol=1e-6, atol=1e-6)
        for name, module in (("attn.w_o", "attn.c_proj"), ("ffn.up", "mlp.c_fc"),
                             ("ffn.down", "mlp.c_proj")):
            lora = loras[f"transformer.h.{i}.{module}"]
            want = (base.get_parameter(f"blocks.{i}.{name}.weight").detach()
                    + s * lora.lora_B.detach() @ lora.lora_A.detach())
            torch.testing.assert_close(merged[f"blocks.{i}.{name}.weight"], want,
                                       rtol=1e-6, atol=1e-6)
    # the base itself is untouched by the merge
    assert all(torch.equal(p, q) for p, q in zip(base.parameters(),
                                                  small_gpt().parameters(), strict=True))


@pytest.mark.parametrize("fused", [False, True])
def test_a_model_with_merged_weights_computes_the_adapted_logits(fused: bool) -> None:
    base = small_gpt() if not fused else small_llama(fused=True)
    model = copy.deepcopy(base)
    adapter = attach(model, LoRASettings(rank=4, alpha=8.0, dropout=0.2), seed=2)
    randomise_lora(adapter)
    set_mode(model, adapter, False)
    fresh = copy.deepcopy(base)
    _, unexpected = fresh.load_state_dict(merged_weights(base, adapter), strict=False)
    assert unexpected == []
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]])
    with torch.no_grad():
        adapted, merged, plain = model(ids).logits, fresh(ids).logits, base(ids).logits
    assert float((adapted - plain).abs().max()) > 0.1  # the update matters
    # float32 rounding of two routes, relative to the logits' size (up to ~5 for the Llama)
    scale = max(1.0, float(adapted.abs().max()))
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-5 * scale)


# -- dropout ----------------------------------------------------------------------------------
def test_dropout_acts_in_training_only() -> None:
    base = small_gpt()
    model = copy.deepcopy(base)
    adapter = attach(model, LoRASettings(rank=4, alpha=8.0, dropout=0.5), seed=0)
    randomise_lora(adapter)
    layer = model.get_submodule("blocks.0.attn.w_v")
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        set_mode(model, adapter, True)
        first, second = layer(x), layer(x)
        set_mode(model, adapter, False)
        still, again = layer(x), layer(x)
    assert not torch.equal(first, second)
    assert torch.equal(still, again)
    plain = base.get_submodule("blocks.0.attn.w_v")
    lora = adapter.each()[0]
    want = x @ plain.weight.T + plain.bias + 2.0 * (x @ lora.lora_A.T) @ lora.lora_B[64:].T
    torch.testing.assert_close(still, want.detach(), rtol=1e-5, atol=1e-5)
    # in training the base part is untouched: only the update's input is dropped
    assert not torch.allclose(first, still, atol=1e-3)
