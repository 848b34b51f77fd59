"""The Llama architecture in our model, against transformers' own Llama and Qwen2.

Random-weight LlamaForCausalLM / Qwen2ForCausalLM models are built locally (nothing is
downloaded), imported through ``attnserve import``'s code path, and compared with
transformers run in eager attention: logits, attention weights, cached decode, and the
refusals of configurations the importer cannot convert exactly.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from model.architectures import architecture
from model.checkpoint import load_checkpoint
from model.config import GPTConfig, config_from_preset
from model.gpt import GPT
from model.hf_import import ImportRefused, import_hf_checkpoint
from tests.conftest import torch_threads
from tests.hf_llama import IM_END, build_hf_model, hf_config, randomise

LLAMA = architecture("llama")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def one_thread() -> Any:
    with torch_threads(1):
        yield


@pytest.fixture(scope="module",
                params=["llama", "qwen2", "qwen3", "smollm3", "mistral", "phi3", "gemma3"])
def imported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[str, Any, Any, Path]:
    """(family, transformers model, our imported GPT, HF directory)."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    hf = build_hf_model(root / "hf", family, seed=3)
    import_hf_checkpoint(root / "hf", root / "ckpt")
    return family, hf, load_checkpoint(root / "ckpt").model, root


@torch.no_grad()
def test_logits_and_attention_equal_transformers(imported: tuple[str, Any, Any, Path]) -> None:
    family, hf, ours, _ = imported
    ids = torch.randint(0, 400, (2, 23), generator=torch.Generator().manual_seed(0))
    ref = hf(ids, output_attentions=True)
    out = ours(ids, return_intermediates=True)
    assert (out.logits - ref.logits).abs().max() <= 1e-4
    assert len(out.intermediates) == len(ref.attentions) == 2
    for inter, want in zip(out.intermediates, ref.attentions, strict=True):
        assert inter.weights.shape == want.shape == (2, 4, 23, 23)
        assert (inter.weights - want).abs().max() <= 1e-5
        # Keys and values recorded per query head: heads 0-1 share kv head 0, 2-3 kv head 1.
        assert torch.equal(inter.k[:, 0], inter.k[:, 1]) and torch.equal(inter.v[:, 2],
                                                                         inter.v[:, 3])
        assert not torch.equal(inter.k[:, 1], inter.k[:, 2])
    assert ours.config.kv_head_of(3) == 1 and ours.config.kv_heads == 2
    if family == "qwen2":
        assert ours.blocks[0].attn.w_q.bias is not None and ours.blocks[0].attn.w_o.bias is None
        assert ours.config.tie_weights
    if family == "mistral":  # each query sees its last 5 positions, itself included
        assert ours.config.sliding_window == 5
        weights = out.intermediates[0].weights  # (B, nh, T, T)
        assert float(weights[:, :, 10, :6].abs().max()) == 0.0 and bool(
            (weights[:, :, 10, 6:11] > 0).all())
    if family == "gemma3":  # sandwich norms, scaled embedding, a window layer of its own base
        cfg = ours.config
        assert cfg.post_norms and cfg.embed_scale and cfg.window_layers == (0,)
        assert cfg.local_rotary(0) and not cfg.local_rotary(1) and cfg.sliding_window == 5
    if family == "phi3":  # fused on disk, split in the model; a window of 6
        assert ours.config.fused_projections and ours.config.sliding_window == 6
    if family == "smollm3":  # the second layer attends without rotary
        assert ours.config.nope_layers == (1,) and not ours.config.rotates(1)
    if family == "qwen3":  # per-head norms, heads wider than d_model / n_heads, no biases
        attn = ours.blocks[0].attn
        assert attn.q_norm is not None and attn.w_q.bias is None
        assert ours.config.head_dim == 32 and attn.w_q.weight.shape == (128, 64)
        assert ours.num_params() == ours.config.num_params_closed_form() == sum(
            p.numel() for p in hf.parameters())


@torch.no_grad()
def test_cached_decode_with_left_padding_equals_transformers(
        imported: tuple[str, Any, Any, Path]) -> None:
    _, hf, ours, _ = imported
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 400, (2, 14), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # row 0 left-padded
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    prefill = ours(ids[:, :10], attention_mask=mask[:, :10], position_ids=pos[:, :10])
    # the cache holds kv heads only
    assert prefill.present[0][0].shape == (2, 2, 10, ours.config.head_dim)
    step = ours(ids[:, 10:], attention_mask=mask, position_ids=pos[:, 10:],
                past_key_values=prefill.present)
    ref = hf(ids, attention_mask=mask, position_ids=pos).logits
    assert (step.logits - ref[:, 10:]).abs().max() <= 1e-4
    assert (prefill.logits[1] - ref[1, :10]).abs().max() <= 1e-4


def test_import_copies_chat_template_and_generation_config(
        imported: tuple[str, Any, Any, Path]) -> None:
    family, _, _, root = imported
    ckpt = root / "ckpt"
    for name in ("tokenizer_config.json", "generation_config.json"):
        assert (ckpt / name).read_bytes() == (root / "hf" / name).read_bytes()
    template = "chat_template.jinja"
    assert (ckpt / template).is_file() == (family in ("qwen2", "qwen3"))
    meta = json.loads((ckpt / "config.json").read_text())
    ids = json.loads((root / "hf" / "tokenizer.json").read_text())["added_tokens"]
    im_end = next(t["id"] for t in ids if t["content"] == IM_END)
    assert meta["tokenizer"]["eos_token_id"] == im_end  # generation_config's first stop id
    assert meta["training"]["imported_from"]["architecture"] == {
        "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
        "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM",
        "gemma3": "Gemma3ForCausalLM"}[family]


@torch.no_grad()
def test_llama3_rope_scaling_equals_transformers() -> None:
    from transformers import LlamaForCausalLM

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    ids = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    cfg = hf_config("llama", 64, ids, rope_scaling=scaling, rope_theta=500000.0,
                    head_dim=16)
    cfg._attn_implementation = "eager"
    hf = LlamaForCausalLM(cfg).eval()
    randomise(hf, 5)
    ours = GPT(LLAMA.config_from_hf(cfg.to_dict(), ValueError)).eval()
    ours.load_state_dict(LLAMA.state_dict_from_hf(hf.state_dict(), ours.config))
    x = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(2))
    assert (ours(x).logits - hf(x).logits).abs().max() <= 1e-4


@torch.no_grad()
def test_smollm2_135m_shape_logits_equal_transformers() -> None:
    """SmolLM2-135M's exact shape (576 wide, 30 layers, 9 heads / 3 kv heads, SwiGLU 1536,
    tied), with the vocabulary cut to 512 rows to keep the test light."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                      tie_word_embeddings=True, attn_implementation="eager")
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).eval()
    ours = GPT(LLAMA.config_from_hf(cfg.to_dict(), ValueError)).eval()
    ours.load_state_dict(LLAMA.state_dict_from_hf(hf.state_dict(), ours.config))
    assert ours.num_params() == ours.config.num_params_closed_form() == sum(
        p.numel() for p in hf.parameters())
    x = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(3))
    assert (ours(x).logits - hf(x).logits).abs().max() <= 1e-4


@torch.no_grad()
def test_qwen25_05b_layer_shape_logits_equal_transformers() -> None:
    """Qwen2.5-0.5B's layer shape (896 wide, 14 heads / 2 kv heads, Q/K/V biases, SwiGLU
    4864, tied, θ = 10⁶) with 2 of its 24 layers and a 512-row vocabulary."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=512, hidden_size=896, intermediate_size=4864,
                      num_hidden_layers=2, num_attention_heads=14, num_key_value_heads=2,
                      max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6,
                      tie_word_embeddings=True, attn_implementation="eager")
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(cfg).eval()
    randomise(hf, 7, std=0.05)
    ours = GPT(LLAMA.config_from_hf(cfg.to_dict(), ValueError)).eval()
    ours.load_state_dict(LLAMA.state_dict_from_hf(hf.state_dict(), ours.config))
    x = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(4))
    assert (ours(x).logits - hf(x).logits).abs().max() <= 1e-4


def _edit_config(src: Path, **changes: Any) -> None:
    path = src / "config.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(("change", "message"), [
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn'"),
    # a head width the weights do not have (wider heads themselves are Qwen3's, and served)
    ({"head_dim": 32}, r"q_proj\.weight has shape \[64, 64\], config\.json implies \[128, 64\]"),
    ({"architectures": ["Qwen2ForSequenceClassification"]}, "architectures"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
])
def test_unconvertible_configs_are_refused_leaving_nothing(
        tmp_path: Path, change: dict[str, Any], message: str) -> None:
    src = tmp_path / "hf"
    build_hf_model(src, "qwen2", seed=1)
    _edit_config(src, **change)
    with pytest.raises(ImportRefused, match=message) as info:
        import_hf_checkpoint(src, tmp_path / "out")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_llama_without_tokenizer_json_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "hf"
    build_hf_model(src, "llama", seed=1)
    (src / "tokenizer.json").unlink()
    with pytest.raises(ImportRefused, match=r"has no tokenizer\.json"):
        import_hf_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_old_config_loads_as_gpt_and_llama_presets_build() -> None:
    old = {"vocab_size": 10, "d_model": 8, "n_heads": 2, "n_layers": 1, "d_ff": 16,
           "max_seq_len": 6, "dropout": 0.0, "position": "learned", "activation": "relu",
           "tie_weights": False, "layer_norm_eps": 1e-5}
    config = GPTConfig.from_dict(old)
    assert config.arch == "gpt" and config.kv_heads == 2 and config.n_kv_heads is None
    tiny = config_from_preset("llama-tiny", vocab_size=300, position="learned",
                              activation="relu", tie_weights=True)
    assert (tiny.arch, tiny.position, tiny.activation, tiny.kv_heads) == (
        "llama", "rope", "silu", 2)
    assert GPT(tiny).num_params() == tiny.num_params_closed_form()
    biased = GPTConfig(**(tiny.to_dict() | {"qkv_bias": True, "mlp_bias": True,
                                             "attn_bias": True, "tie_weights": False}))
    assert GPT(biased).num_params() == biased.num_params_closed_form()
    with pytest.raises(ValueError, match="n_kv_heads"):
        GPTConfig(**(tiny.to_dict() | {"n_kv_heads": 3}))
    with pytest.raises(ValueError, match="position"):
        GPTConfig(**(tiny.to_dict() | {"position": "learned"}))
    with pytest.raises(ValueError, match="rope_scaling"):
        GPTConfig(**(tiny.to_dict() | {"rope_scaling": {"rope_type": "dynamic",
                                                        "factor": 2.0}}))


@torch.no_grad()
def test_grouped_attention_paths_agree() -> None:
    """sdpa (enable_gqa), the explicit grouped matmul and intermediates: one function."""
    config = config_from_preset("llama-tiny", vocab_size=300)
    torch.manual_seed(0)
    model = GPT(config).eval()
    x = torch.randint(0, 300, (2, 12))
    fast = model(x).logits
    model.set_attention_impl("matmul")
    assert (model(x).logits - fast).abs().max() <= 1e-5
    assert (model(x, return_intermediates=True).logits - fast).abs().max() <= 1e-5


def test_training_cli_trains_a_llama(tmp_path: Path) -> None:
    """`attnserve train --arch llama`: the pipeline, not only import, covers the family."""
    from model.train import TrainOptions, train

    corpus = tmp_path / "corpus.txt"
    from tests.conftest import tiny_corpus

    corpus.write_text(tiny_corpus()[:40_000], "utf-8")
    opts = {"out": str(tmp_path / "ckpt"), "data": str(corpus), "steps": 3,
            "tokenizer": "char", "context": 32, "batch_size": 4, "eval_tokens": 128,
            "progress": False, "verbose": False}
    result = train(TrainOptions(**opts, arch="llama", preset="llama-tiny"))  # type: ignore[arg-type]
    config = load_checkpoint(result.out).meta.model
    assert (config.arch, config.kv_heads, config.position) == ("llama", 2, "rope")
    assert result.num_params == config.num_params_closed_form()
    with pytest.raises(ValueError, match=r"with --arch llama choose one of \['llama-small', "
                                         r"'llama-tiny'\]"):
        train(TrainOptions(**opts, arch="llama", preset="tiny"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--position and --activation apply to the gpt"):
        train(TrainOptions(**opts, preset="llama-tiny",  # type: ignore[arg-type]
                           position="sinusoidal"))


@torch.no_grad()
def test_export_format_hf_gives_back_the_same_model(imported: tuple[str, Any, Any, Path]
                                                    ) -> None:
    """`attnserve export --format hf` of an import: the same tensors, the same class, and
    transformers computes the same logits from it. Gemma's norms are stored as w of
    (1 + w) and imported as 1 + w, so they come back within float32's rounding of that add
    (an ulp of 1: 2⁻²³), the logits within float32 rounding."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from export.to_hf import export_hf

    family, hf, _, root = imported
    out = export_hf(root / "ckpt", root / "back")
    source = load_file(str(root / "hf" / "model.safetensors"))
    back = load_file(str(out / "model.safetensors"))
    assert sorted(back) == sorted(source)
    folded = [k for k in source if family == "gemma3" and k.endswith("norm.weight")]
    assert all(torch.equal(back[k], source[k]) for k in source if k not in folded)
    assert all((back[k] - source[k]).abs().max() <= 2.0 ** -23 for k in folded)
    again = AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    assert type(again) is type(hf)
    x = torch.randint(0, 400, (1, 15), generator=torch.Generator().manual_seed(6))
    if folded:
        assert (again(x).logits - hf(x).logits).abs().max() <= 1e-5
    else:
        assert torch.equal(again(x).logits, hf(x).logits)


@torch.no_grad()
def test_longrope_up_to_the_pretrained_length_equals_transformers() -> None:
    """Phi-3.5's LongRoPE: the short factors and the attention factor sqrt(1 + ln(L/L0) /
    ln L0) scaling cos and sin, served up to the pretrained length L0 (past it transformers
    switches to the long factors, which the static tables cannot follow: the context is
    capped there)."""
    from transformers import Phi3ForCausalLM

    ids = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    rng = np.random.default_rng(0)
    scaling = {"type": "longrope", "short_factor": (1 + rng.random(8)).tolist(),
               "long_factor": (4 + 8 * rng.random(8)).tolist()}
    cfg = hf_config("phi3", 64, ids, rope_scaling=scaling, max_position_embeddings=256,
                    original_max_position_embeddings=32, sliding_window=None)
    cfg._attn_implementation = "eager"
    hf = Phi3ForCausalLM(cfg).eval()
    randomise(hf, 6)
    config = LLAMA.config_from_hf(cfg.to_dict(), ValueError)
    assert config.max_seq_len == 32 and config.rope_scaling is not None
    assert config.rope_scaling["attention_factor"] == pytest.approx(
        math.sqrt(1 + math.log(256 / 32) / math.log(32)))
    ours = GPT(config).eval()
    ours.load_state_dict(LLAMA.state_dict_from_hf(hf.state_dict(), config))
    x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(2))
    assert (ours(x).logits - hf(x).logits).abs().max() <= 1e-4


@torch.no_grad()
@pytest.mark.parametrize("layout", ["as saved", "model.language_model."])
def test_multimodal_gemma3_imports_its_text_model(tmp_path: Path, layout: str) -> None:
    """A Gemma3ForConditionalGeneration directory (model_type gemma3, its text model under
    text_config) imports as its text model, the vision tower left out: logits and greedy
    tokens equal transformers' multimodal model on text. transformers 4.57 saves the
    weights as language_model.model.* (the hub's Gemma 3 files' names); later ones as
    model.language_model.*, written here by renaming."""
    from safetensors.torch import load_file, save_file
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    from model.sample import generate
    from tests.hf_llama import write_tokenizer

    ids = write_tokenizer(tmp_path / "hf", "gemma3")
    text = hf_config("gemma3", 400, ids).to_dict()
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    cfg = Gemma3Config(text_config=text, vision_config=vision.to_dict(), mm_tokens_per_image=4,
                       image_token_index=399, boi_token_index=397, eoi_token_index=398)
    cfg._attn_implementation = "eager"
    hf = Gemma3ForConditionalGeneration(cfg).eval()
    randomise(hf, 7)
    hf.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    weights = tmp_path / "hf" / "model.safetensors"
    assert any(name.startswith("language_model.model.") for name in load_file(weights))
    if layout == "model.language_model.":
        save_file({"model." + name.replace("language_model.model.", "language_model.")
                   if not name.startswith("lm_head") else name: tensor
                   for name, tensor in load_file(weights).items()}, weights,
                  metadata={"format": "pt"})
    ours = load_checkpoint(import_hf_checkpoint(tmp_path / "hf", tmp_path / "ckpt")).model
    assert ours.config.post_norms and ours.config.window_layers == (0,)
    x = torch.randint(0, 397, (2, 23), generator=torch.Generator().manual_seed(4))
    assert (ours(x).logits - hf(input_ids=x).logits).abs().max() <= 1e-4
    mine = generate(ours, x[:1, :8], 8, greedy=True).new_tokens(8)
    theirs = hf.generate(input_ids=x[:1, :8], max_new_tokens=8, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    assert mine[0].tolist() == theirs[0, 8:].tolist()
