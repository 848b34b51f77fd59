"""`attnserve merge` refuses, with one line and nothing written, what it cannot fold
exactly: DoRA, modules_to_save, trained biases, a target the model lacks, an adapter of
another base's shapes, pickle, a directory that is not an adapter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from model.checkpoint import CheckpointMeta, save_checkpoint
from model.config import config_from_preset
from model.gpt import GPT

BIN = Path(sys.executable).parent
PREFIX = "base_model.model.model.layers.0."


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A llama-tiny checkpoint (d 64, 2 layers, 4 heads of 16 with 2 KV heads, d_ff 192)."""
    from tokenizers import Tokenizer, models

    config = config_from_preset("llama-tiny", vocab_size=32)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(32)}, unk_token="w0"))
    out = tmp_path_factory.mktemp("merge") / "ckpt"
    torch.manual_seed(0)
    return save_checkpoint(out, GPT(config), CheckpointMeta(config, {"kind": "test"}),
                           tok.to_str())


def adapter(root: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    root.mkdir()
    base = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    (root / "adapter_config.json").write_text(json.dumps({**base, **config}))
    save_file(tensors, str(root / "adapter_model.safetensors"))
    return root


def q_proj(rows: int = 64, cols: int = 64) -> dict[str, torch.Tensor]:
    return {f"{PREFIX}self_attn.q_proj.lora_A.weight": torch.randn(2, cols),
            f"{PREFIX}self_attn.q_proj.lora_B.weight": torch.randn(rows, 2)}


def run_merge(ckpt: Path, adapter_dir: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "attnserve"), "merge", "--ckpt", str(ckpt), "--adapter",
                           str(adapter_dir), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)


CASES = {
    "dora": ({"use_dora": True}, q_proj(), "DoRA"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, q_proj(), "modules_to_save"),
    "bias": ({"bias": "all"}, q_proj(), "bias 'all'"),
    "not lora": ({"peft_type": "IA3"}, q_proj(), "only LORA adapters"),
    "missing target": ({}, {f"{PREFIX}mlp.experts.lora_A.weight": torch.randn(2, 64),
                            f"{PREFIX}mlp.experts.lora_B.weight": torch.randn(64, 2)},
                       "does not have"),
    "magnitude": ({}, {**q_proj(), f"{PREFIX}self_attn.q_proj.lora_magnitude_vector":
                       torch.randn(64)}, "not a LoRA A or B"),
    "other shapes": ({}, q_proj(rows=128, cols=128), "another base model"),
    "half a pair": ({}, {f"{PREFIX}self_attn.q_proj.lora_A.weight": torch.randn(2, 64)},
                    "not both lora_A and lora_B"),
    "layer out of range": ({}, {k.replace("layers.0.", "layers.7."): v
                                for k, v in q_proj().items()}, "does not have"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_what_cannot_merge_exactly_is_refused_in_one_line(case, ckpt, tmp_path):
    from model.finetune.merge import merge

    config, tensors, reason = CASES[case]
    out = tmp_path / "merged"
    with pytest.raises(ValueError) as refused:
        merge(ckpt, adapter(tmp_path / "adapter", config, tensors), out)
    assert len(str(refused.value).splitlines()) == 1 and reason in str(refused.value)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]


def test_the_cli_refuses_with_exit_2_and_one_line(ckpt, tmp_path):
    config, tensors, reason = CASES["dora"]
    proc = run_merge(ckpt, adapter(tmp_path / "adapter", config, tensors), tmp_path / "out")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and reason in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_pickled_adapter_and_a_plain_directory_are_refused(ckpt, tmp_path):
    from model.finetune.merge import merge

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(ValueError, match="pickle"):
        merge(ckpt, pickled, tmp_path / "out")
    with pytest.raises(ValueError, match=r"adapter_config\.json is missing"):
        merge(ckpt, tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_existing_output_is_kept_without_force(ckpt, tmp_path):
    from model.finetune.merge import merge

    out = tmp_path / "merged"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        merge(ckpt, adapter(tmp_path / "adapter", {}, q_proj()), out)
    assert (out / "keep").read_text() == "x"
