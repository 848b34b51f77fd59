"""`attnserve finetune` end to end on a tiny random Qwen2 (ChatML template, two stop ids):
the loss falls, the adapter is PEFT's, runs repeat and resume exactly, bad data is refused
with its line and nothing written, a full fine-tune writes a checkpoint, and a merged
fine-tune exported to ONNX answers as PEFT over transformers does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from model.finetune.options import FinetuneOptions
from model.finetune.trainer import finetune
from tests.conftest import torch_threads

BIN = Path(sys.executable).parent
FACTS = [("Mira", "blue"), ("Tovo", "green"), ("Ansel", "red"), ("Kes", "gold")]


def chat_lines(n: int) -> list[str]:
    """n conversations teaching which colour each name likes, in varied phrasings."""
    asks = ["What colour does {} like?", "Which colour is {}'s favourite?",
            "Tell me {}'s colour.", "{} likes which colour?"]
    out = []
    for i in range(n):
        name, colour = FACTS[i % len(FACTS)]
        out.append(json.dumps({"messages": [
            {"role": "user", "content": asks[(i // len(FACTS)) % len(asks)].format(name)},
            {"role": "assistant", "content": f"{name} likes {colour}."}]}))
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A random Qwen2 (HF directory and its import) and a chat data set."""
    from model.hf_import import import_hf_checkpoint
    from tests.hf_llama import build_hf_model

    root = tmp_path_factory.mktemp("finetune")
    with torch_threads(1):
        build_hf_model(root / "hf", "qwen2", seed=11)
        ckpt = import_hf_checkpoint(root / "hf", root / "ckpt")
    data = root / "chat.jsonl"
    data.write_text("\n".join(chat_lines(24)) + "\n", encoding="utf-8")
    return {"hf": root / "hf", "ckpt": ckpt, "data": data}


def options(tiny: dict[str, Path], out: Path, **kw: Any) -> FinetuneOptions:
    defaults: dict[str, Any] = {"steps": 6, "batch_size": 4, "lr": 5e-3, "rank": 4,
                                "alpha": 8.0, "progress": False, "verbose": False}
    return FinetuneOptions(ckpt=str(tiny["ckpt"]), data=str(tiny["data"]), out=str(out),
                           **{**defaults, **kw})


def metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_lora_lowers_eval_loss_and_writes_an_adapter_peft_reads(tiny, tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    from model.finetune.lora import wire
    from model.finetune.peft_format import read_adapter
    from model.finetune.tuned import load_base

    out = tmp_path / "adapter"
    with torch_threads(1):
        result = finetune(options(tiny, out, steps=16, lr=2e-2, eval_fraction=0.25))
    assert result is not None and result.eval_before and result.eval_after
    rows = metrics(out)
    assert rows[0]["step"] == 0 and rows[-1]["step"] == 16
    assert rows[-1]["eval_loss"] < 0.7 * rows[0]["eval_loss"]
    assert rows[-1]["eval_token_accuracy"] > rows[0]["eval_token_accuracy"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    assert config["base_model_name_or_path"] == str(tiny["ckpt"].resolve())
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj",
                                             "gate_proj", "up_proj", "down_proj"}

    with torch_threads(1):
        hf = AutoModelForCausalLM.from_pretrained(str(tiny["hf"])).eval()
        reference = peft.PeftModel.from_pretrained(hf, str(out)).eval()
        model, meta, _ = load_base(tiny["ckpt"], full=False)
        wire(model, read_adapter(out, meta.model))
        ids = torch.tensor([[3, 40, 41, 42, 43, 7, 8, 9]])
        with torch.no_grad():
            torch.testing.assert_close(model.eval()(ids).logits, reference(ids).logits,
                                       atol=1e-4, rtol=1e-4)


def test_same_seed_same_adapter_and_resume_ends_where_an_uninterrupted_run_does(tiny, tmp_path):
    class Interrupted(Exception):
        pass

    def stop_at_3(step: int, _out: Path) -> None:
        if step == 3:
            raise Interrupted

    with torch_threads(1):
        finetune(options(tiny, tmp_path / "a"))
        finetune(options(tiny, tmp_path / "b"))
        with pytest.raises(Interrupted):
            finetune(options(tiny, tmp_path / "c", on_save=stop_at_3))
        assert json.loads((tmp_path / "c" / "finetune.json").read_text())["step"] == 3
        finetune(options(tiny, tmp_path / "c", resume=True))
    a, b, c = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in "abc")
    assert a.keys() == b.keys() == c.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
        assert torch.equal(a[key], c[key]), key
    def losses(run: str) -> list[tuple[Any, Any]]:
        return [(r.get("train_loss"), r.get("eval_loss")) for r in metrics(tmp_path / run)]

    assert losses("a") == losses("c")


def test_a_bad_line_is_refused_with_its_number_and_nothing_is_written(tiny, tmp_path):
    lines = chat_lines(4)
    lines[2] = json.dumps({"messages": [{"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": "  "}]})
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    proc = subprocess.run([str(BIN / "attnserve"), "finetune", "--ckpt", str(tiny["ckpt"]),
                           "--data", str(bad), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    message = proc.stderr.strip()
    assert len(message.splitlines()) == 1 and f"{bad}:3:" in message, message
    assert not out.exists()
    assert not any(p.name.startswith(".out") for p in tmp_path.iterdir())


def test_a_non_empty_out_is_refused_without_force(tiny, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not empty"):
        finetune(options(tiny, out))
    assert (out / "precious.txt").read_text() == "keep me"


def test_show_masks_prints_the_supervised_spans_and_writes_nothing(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    assert finetune(options(tiny, out, show_masks=2)) is None
    printed = capsys.readouterr().out
    assert printed.count("--- line ") == 2
    assert "⟦Mira likes blue.<|im_end|>⟧" in printed
    assert not out.exists()


def test_full_finetune_writes_a_checkpoint_of_changed_weights(tiny, tmp_path):
    from model.checkpoint import load_checkpoint, read_meta

    out = tmp_path / "full"
    with torch_threads(1):
        result = finetune(options(tiny, out, full=True, steps=4, lr=1e-3))
        assert result is not None and result.eval_after is not None
        base = load_checkpoint(tiny["ckpt"]).model
        tuned = load_checkpoint(out)
    assert tuned.meta.training["finetuned_from"]["checkpoint"] == str(tiny["ckpt"].resolve())
    assert (out / "chat_template.jinja").read_bytes() == \
        (tiny["ckpt"] / "chat_template.jinja").read_bytes()
    changed = [n for n, p in tuned.model.state_dict().items()
               if not torch.equal(p, base.state_dict()[n])]
    assert len(changed) == len(base.state_dict())  # every weight trained
    assert read_meta(out).model == read_meta(tiny["ckpt"]).model


def test_a_merged_finetune_exported_to_onnx_answers_as_peft_over_transformers(tiny, tmp_path):
    """adapter → merge → export (verified against PyTorch) → a plain ONNX Runtime greedy
    loop gives PEFT's greedy tokens for a chat prompt."""
    import peft
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from export.to_onnx import export_artifact
    from model.finetune.merge import merge
    from service.contract.reference import OrtDecoder, greedy

    adapter = tmp_path / "adapter"
    with torch_threads(1):
        finetune(options(tiny, adapter, steps=10))
        merged = merge(tiny["ckpt"], adapter, tmp_path / "merged")
        artifact = export_artifact(merged, tmp_path / "artifact")
        tok = Tokenizer.from_file(str(tiny["ckpt"] / "tokenizer.json"))
        prompt = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                  "<|im_start|>user\nWhat colour does Tovo like?<|im_end|>\n"
                  "<|im_start|>assistant\n")
        ids = tok.encode(prompt, add_special_tokens=False).ids
        ours = greedy(OrtDecoder.from_artifact(artifact), np.asarray([ids]), 6)[0].tolist()
        hf = AutoModelForCausalLM.from_pretrained(str(tiny["hf"])).eval()
        reference = peft.PeftModel.from_pretrained(hf, str(adapter)).eval()
        with torch.no_grad():
            theirs = reference.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                                        eos_token_id=None)[0, len(ids):].tolist()
    assert ours == theirs
    with pytest.raises(ValueError, match="weights are a fine-tune's"):  # not the file's blocks
        export_artifact(merged, tmp_path / "as-gguf", quantize="gguf")
    assert not (tmp_path / "as-gguf").exists()


@pytest.mark.slow
def test_two_process_ddp_equals_one_process_accumulating_two(tiny, tmp_path):
    """torchrun, 2 ranks of 2 examples each per step == 1 process of 2 micro-batches of 2:
    the loss is normalised by the whole step's tokens, so the gradients agree."""
    torchrun = shutil.which("torchrun", path=str(BIN))
    assert torchrun is not None
    common = ["--ckpt", str(tiny["ckpt"]), "--data", str(tiny["data"]), "--steps", "4",
              "--batch-size", "2", "--lr", "5e-3", "--lora-r", "4", "--lora-dropout", "0",
              "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", "--no-python",
                           str(BIN / "attnserve"), "finetune", *common, "--out",
                           str(tmp_path / "ddp")],
                          capture_output=True, text=True, timeout=600, env=env, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with torch_threads(1):
        finetune(options(tiny, tmp_path / "one", steps=4, batch_size=2, accumulation=2,
                         dropout=0.0, alpha=32.0))
    ddp = load_file(str(tmp_path / "ddp" / "adapter_model.safetensors"))
    one = load_file(str(tmp_path / "one" / "adapter_model.safetensors"))
    for key in one:
        torch.testing.assert_close(ddp[key], one[key], atol=1e-5, rtol=1e-4)
    assert any(one[k].abs().sum() > 0 for k in one if "lora_B" in k)
