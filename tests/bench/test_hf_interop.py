"""The transformers copy computes what our model computes: logits ≤ 1e-4, same greedy text.

Each config is built with non-trivial LayerNorm and bias values (not the identity/zero
init) so a parameter mapped to the wrong place cannot hide.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from export.to_hf import export_hf
from model.checkpoint import CheckpointMeta, load_checkpoint, save_checkpoint
from model.config import GPTConfig
from model.gpt import GPT

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "learned-relu-untied": dict(position="learned", activation="relu", tie_weights=False),
    "sinusoidal-gelu-tied": dict(position="sinusoidal", activation="gelu", tie_weights=True),
    "learned-gelu-tied": dict(position="learned", activation="gelu", tie_weights=True),
    "sinusoidal-relu-untied": dict(position="sinusoidal", activation="relu", tie_weights=False),
}
VOCAB = 97
SPECIAL = {"kind": "bpe", "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _tokenizer_json(tiny_checkpoint: Path) -> str:
    return (tiny_checkpoint / "tokenizer.json").read_text(encoding="utf-8")


def _build_checkpoint(out: Path, tokenizer_json: str, **switches: object) -> Path:
    config = GPTConfig(vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2, d_ff=64,
                       max_seq_len=48, layer_norm_eps=1e-5, **switches)  # type: ignore[arg-type]
    torch.manual_seed(7)
    model = GPT(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight") and p.dim() == 1:  # LayerNorm gains
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    meta = CheckpointMeta(model=config, tokenizer=dict(SPECIAL))
    return save_checkpoint(out, model, meta, tokenizer_json)


def _hf_model(ckpt: Path, out: Path):  # type: ignore[no-untyped-def]
    export_hf(ckpt, out)
    model = transformers.GPT2LMHeadModel.from_pretrained(str(out), local_files_only=True)
    return model.eval()


def _our_greedy(model: GPT, prompt: torch.Tensor, n: int, eos: int) -> list[int]:
    """Reference greedy loop through our KV cache; stops after emitting ``eos``."""
    out: list[int] = []
    with torch.no_grad():
        res = model(prompt)
        past = res.present
        for _ in range(n):
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            if nxt == eos:
                break
            res = model(torch.tensor([[nxt]]), past_key_values=past)
            past = res.present
    return out


def _hf_greedy(hf, prompt: torch.Tensor, n: int) -> list[int]:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        seq = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                          do_sample=False, use_cache=True)
    return [int(t) for t in seq[0, prompt.shape[1]:]]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_greedy_match(name: str, tiny_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = _build_checkpoint(tmp_path / "ckpt", _tokenizer_json(tiny_checkpoint), **CONFIGS[name])
    ours = load_checkpoint(ckpt).model
    hf = _hf_model(ckpt, tmp_path / "hf")

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (3, 40), generator=gen)  # (B, T)
    with torch.no_grad():
        ref = ours(ids).logits  # (B, T, V)
        got = hf(ids).logits  # (B, T, V)
    assert got.shape == ref.shape
    assert float((got - ref).abs().max()) <= 1e-4

    prompt = ids[:1, :8]
    ref_tokens = _our_greedy(ours, prompt, 32, eos=SPECIAL["eos_token_id"])
    assert _hf_greedy(hf, prompt, 32) == ref_tokens


def test_left_padded_batch_matches(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """attention_mask and position_ids mean the same thing on both sides."""
    ckpt = _build_checkpoint(tmp_path / "ckpt", _tokenizer_json(tiny_checkpoint),
                             **CONFIGS["learned-relu-untied"])
    ours = load_checkpoint(ckpt).model
    hf = _hf_model(ckpt, tmp_path / "hf")
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # row 0 is left-padded by 5
    ids[0, :5] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = ours(ids, attention_mask=mask, position_ids=positions).logits
        got = hf(ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    assert float((got[real] - ref[real]).abs().max()) <= 1e-4


def test_trained_checkpoint_generates_same_text(tiny_checkpoint: Path, tmp_path: Path) -> None:
    ours = load_checkpoint(tiny_checkpoint).model
    hf = _hf_model(tiny_checkpoint, tmp_path / "hf")
    eos = int(json.loads((tiny_checkpoint / "config.json").read_text())["tokenizer"]
              ["eos_token_id"])
    prompt = torch.tensor([[5, 17, 40, 99, 23, 61]])
    ref_tokens = _our_greedy(ours, prompt, 40, eos=eos)
    assert len(ref_tokens) > 1
    assert _hf_greedy(hf, prompt, 40) == ref_tokens


def test_export_refuses_non_empty_output(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        export_hf(tiny_checkpoint, out)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    export_hf(tiny_checkpoint, out, force=True)
    assert (out / "model.safetensors").is_file() and not (out / "keep.txt").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["activation_function"] == "relu"
    # No stray temporary directory is left next to the output.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
