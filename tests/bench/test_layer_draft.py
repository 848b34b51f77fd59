"""benchmarks/layer_draft.py: the early-exit draft is the target's first K blocks, exactly.

Reference: the target model itself with its block list cut to K in PyTorch; the draft
checkpoint, loaded on its own, must give the same logits, and keep the target's tokenizer
(the server refuses a draft whose tokenizer differs).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from benchmarks.layer_draft import cut_checkpoint, main
from model.checkpoint import load_checkpoint


def test_draft_is_the_first_blocks_of_the_target(tiny_checkpoint: Path, tmp_path: Path) -> None:
    target = load_checkpoint(tiny_checkpoint)
    draft = load_checkpoint(cut_checkpoint(tiny_checkpoint, 1, tmp_path / "draft"))
    assert draft.meta.model.n_layers == 1
    assert draft.meta.training["draft_of"]["of"] == target.meta.model.n_layers
    assert draft.tokenizer_path.read_bytes() == target.tokenizer_path.read_bytes()

    early_exit = copy.deepcopy(target.model)
    early_exit.blocks = early_exit.blocks[:1]
    ids = torch.randint(0, target.meta.model.vocab_size, (2, 9))
    with torch.no_grad():
        expected = early_exit(ids).logits
        got = draft.model(ids).logits
        full = target.model(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert not torch.allclose(got, full)  # it is not the whole model


def test_bad_layer_count_exits_2(tiny_checkpoint: Path, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    layers = load_checkpoint(tiny_checkpoint).meta.model.n_layers
    assert main(["--ckpt", str(tiny_checkpoint), "--layers", str(layers),
                 "--out", str(tmp_path / "d")]) == 2
    assert "--layers must be in 1.." in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
