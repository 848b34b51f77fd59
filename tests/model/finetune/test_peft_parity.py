"""Our LoRA adapters are PEFT's: PEFT over transformers computes our logits, both ways.

The reference is PEFT's LoraModel over transformers' own model of the same weights (a
Hugging Face directory built here, or the GGUF file read by transformers' GGUF loader):
an adapter we write must load there (key names, shapes, scaling, GPT-2's Conv1D and
Phi-3's fused projections) and give our logits and greedy tokens; an adapter PEFT writes
(rsLoRA, per-module ranks and alphas) must give PEFT's logits here, and merged by us,
those of PEFT's own merge.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from model.checkpoint import load_checkpoint, read_meta
from model.finetune.lora import Adapter, LoRASettings, attach, wire
from model.finetune.merge import merge
from model.finetune.peft_format import adapter_files, read_adapter
from model.finetune.tuned import load_base
from tests.conftest import torch_threads

peft = pytest.importorskip("peft")


def randomised(adapter: Adapter, seed: int, std: float = 0.05) -> Adapter:
    """A and B of every LoRA drawn at random (a trained adapter's B is not zero)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lora in adapter.each():
            lora.lora_A.copy_(torch.randn(lora.lora_A.shape, generator=gen) * std * 4)
            lora.lora_B.copy_(torch.randn(lora.lora_B.shape, generator=gen) * std)
    return adapter.eval()


def write(adapter: Adapter, out: Path, base: Path) -> Path:
    out.mkdir(parents=True)
    for name, content in adapter_files(adapter, str(base)).items():
        (out / name).write_bytes(content)
    return out


def peft_model(hf: Any, adapter_dir: Path) -> Any:
    return peft.PeftModel.from_pretrained(hf, str(adapter_dir)).eval()


def ours_with(ckpt: Path, settings: LoRASettings, seed: int) -> tuple[Any, Adapter]:
    model, _, _ = load_base(ckpt, full=False)
    adapter = randomised(attach(model, settings, seed), seed)
    return model.eval(), adapter


def logits_of(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out[0]


def greedy(model: Any, ids: torch.Tensor, steps: int) -> list[int]:
    """Greedy continuation by a plain loop over the whole sequence (no cache), the same
    loop for both models."""
    seq = ids
    for _ in range(steps):
        nxt = logits_of(model, seq)[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    return seq[0, ids.shape[1]:].tolist()


@pytest.mark.slow
def test_smollm2_gguf_adapter_loads_in_peft_over_transformers_gguf(
        smollm2_checkpoint, smollm2_transformers, tmp_path):
    """The real model, its base held as the file's Q4_1 blocks: PEFT over transformers'
    model of the same GGUF gives our logits and our greedy tokens."""
    with torch_threads(2):
        ours, adapter = ours_with(smollm2_checkpoint, LoRASettings(), seed=3)
        out = write(adapter, tmp_path / "adapter", smollm2_checkpoint)
        # a copy: PEFT wraps the model it is given, and the session's is shared
        hf = copy.deepcopy(smollm2_transformers[0])
        ids = torch.tensor([[1, 9690, 198, 2683, 314, 253, 5356, 2, 198, 1, 520, 9531, 198]])
        base = logits_of(hf, ids)
        theirs = peft_model(hf, out)
        reference = logits_of(theirs, ids)
        mine = logits_of(ours, ids)
        assert (reference - base).abs().max() > 0.5  # the adapter matters
        torch.testing.assert_close(mine, reference, atol=2e-4, rtol=1e-4)
        assert greedy(ours, ids, 6) == greedy(theirs, ids, 6)


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3", "gemma3"])
def test_llama_family_adapters_load_in_peft(family, tmp_path):
    """GQA (llama), Q/K/V biases (qwen2), fused qkv_proj / gate_up_proj (phi3: our three
    layers share A and cut B), Gemma 3's sandwich norms: PEFT reads our keys."""
    from model.hf_import import import_hf_checkpoint
    from tests.hf_llama import build_hf_model

    with torch_threads(1):
        hf = build_hf_model(tmp_path / "hf", family, seed=1)
        ckpt = import_hf_checkpoint(tmp_path / "hf", tmp_path / "ckpt")
        ours, adapter = ours_with(ckpt, LoRASettings(rank=4, alpha=8.0), seed=2)
        out = write(adapter, tmp_path / "adapter", ckpt)
        ids = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 31]])
        base = logits_of(hf, ids)
        reference = logits_of(peft_model(hf, out), ids)
        assert (reference - base).abs().max() > 1e-2
        torch.testing.assert_close(logits_of(ours, ids), reference, atol=1e-4, rtol=1e-4)


def test_gpt2_conv1d_adapter_loads_in_peft(tmp_path):
    """GPT-2's Conv1D layers (fan_in_fan_out) and its fused c_attn; rsLoRA scaling and a
    subset of targets."""
    from model.hf_import import import_hf_checkpoint
    from tests.hf_gpt2 import build_hf_model, load_hf_model

    with torch_threads(1):
        hf = load_hf_model(build_hf_model(tmp_path / "hf"))
        ckpt = import_hf_checkpoint(tmp_path / "hf", tmp_path / "ckpt")
        settings = LoRASettings(rank=4, alpha=6.0, rslora=True, targets=("c_attn", "c_fc"))
        ours, adapter = ours_with(ckpt, settings, seed=4)
        out = write(adapter, tmp_path / "adapter", ckpt)
        ids = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 31]])
        reference = logits_of(peft_model(hf, out), ids)
        torch.testing.assert_close(logits_of(ours, ids), reference, atol=1e-4, rtol=1e-4)


def test_k_quant_gguf_base_with_adapter_matches_peft(tmp_path):
    """A GGUF of K-quant and legacy blocks, held as blocks under the adapter: transformers
    dequantises the same file, PEFT adds the same update."""
    import gguf
    from transformers import AutoModelForCausalLM

    from model.gguf.to_checkpoint import import_gguf_checkpoint
    from tests.gguf_files import write_gguf
    from tests.hf_llama import build_hf_model

    Q = gguf.GGMLQuantizationType
    with torch_threads(1):
        build_hf_model(tmp_path / "hf", "llama", seed=5, hidden_size=256, intermediate_size=256,
                       num_attention_heads=4, num_key_value_heads=2)
        path = write_gguf(tmp_path / "hf", tmp_path / "m.gguf",
                          types=(Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_1))
        ckpt = import_gguf_checkpoint(path, tmp_path / "ckpt")
        ours, adapter = ours_with(ckpt, LoRASettings(rank=8), seed=6)
        assert type(ours.blocks[0].attn.w_q.base).__name__ == "FrozenLinear"
        out = write(adapter, tmp_path / "adapter", ckpt)
        hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf",
                                                  dtype=torch.float32).eval()
        ids = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 31]])
        reference = logits_of(peft_model(hf, out), ids)
        torch.testing.assert_close(logits_of(ours, ids), reference, atol=1e-4, rtol=1e-4)


def test_an_adapter_written_by_peft_gives_peft_logits_here_and_merges_as_peft(tmp_path):
    """PEFT's own adapter (rsLoRA, rank_pattern, alpha_pattern, a subset of modules and
    layers) read by us: our adapted model gives PEFT's logits, and our merged checkpoint
    those of PEFT's merge_and_unload."""
    from model.hf_import import import_hf_checkpoint
    from tests.hf_llama import build_hf_model

    with torch_threads(1):
        hf = build_hf_model(tmp_path / "hf", "qwen2", seed=7)
        ckpt = import_hf_checkpoint(tmp_path / "hf", tmp_path / "ckpt")
        config = peft.LoraConfig(
            r=4, lora_alpha=12, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"],
            rank_pattern={"down_proj": 2}, alpha_pattern={"layers.1.self_attn.v_proj": 3},
            layers_to_transform=[0, 1], init_lora_weights=False, task_type="CAUSAL_LM")
        torch.manual_seed(0)
        theirs = peft.get_peft_model(hf, config).eval()
        theirs.save_pretrained(str(tmp_path / "peft-adapter"))
        ids = torch.tensor([[9, 8, 7, 6, 5, 4, 3, 2]])
        reference = logits_of(theirs, ids)

        model, meta, _ = load_base(ckpt, full=False)
        adapter = read_adapter(tmp_path / "peft-adapter", meta.model)
        assert {lora.lora_A.shape[0] for lora in adapter.each()} == {4, 2}
        wire(model, adapter)
        torch.testing.assert_close(logits_of(model.eval(), ids), reference, atol=1e-5,
                                   rtol=1e-5)

        merged_reference = logits_of(theirs.merge_and_unload(), ids)
        merged = merge(ckpt, tmp_path / "peft-adapter", tmp_path / "merged")
        torch.testing.assert_close(logits_of(load_checkpoint(merged).model, ids),
                                   merged_reference, atol=1e-5, rtol=1e-5)
        assert read_meta(merged).training["merged_from"]["modules"] == len(adapter.loras)
