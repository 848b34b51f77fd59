"""The benchmark's CTranslate2 peer: a tiny random GPT-2, converted from its transformers
directory, must decode the same greedy tokens as our model imported from that directory."""

from __future__ import annotations

from pathlib import Path

import pytest

ctranslate2 = pytest.importorskip("ctranslate2", reason="ctranslate2 is not installed")


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from model.hf_import import import_hf_checkpoint
    from tests.hf_gpt2 import build_hf_model

    root = tmp_path_factory.mktemp("ct2-gpt2")
    hf = build_hf_model(root / "hf", n_positions=64, n_embd=32, n_layer=2, n_head=4, seed=5)
    return hf, import_hf_checkpoint(hf, root / "ckpt")


@pytest.mark.parametrize("batch", [1, 3])
def test_ct2_greedy_tokens_equal_ours(tiny_gpt2: tuple[Path, Path], tmp_path: Path,
                                      batch: int) -> None:
    from benchmarks.lib.runners_ct2 import CT2Generator, convert
    from benchmarks.lib.runners_torch import TorchKV

    hf, ckpt = tiny_gpt2
    figures = convert(hf, tmp_path / "ct2", "float32")
    assert figures["quantization"] == "float32"
    prompts = [[(7 * row + 3 * i) % 300 + 1 for i in range(10)] for row in range(batch)]
    ct2 = CT2Generator(tmp_path / "ct2", threads=1).generate(prompts, 12)
    ours = TorchKV(ckpt).generate(prompts, 12)
    assert ct2.tokens == ours.tokens
    assert 0 < ct2.ttft_s <= ct2.total_s
