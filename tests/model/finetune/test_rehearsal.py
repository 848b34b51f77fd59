"""Self-rehearsal (model/finetune/rehearsal.py): the examples are the base model's own
greedy answers, as transformers generates them from the same GGUF file, and a fine-tune
trains on them beside its data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer

from model.checkpoint import TOKENIZER_FILE, read_meta
from model.finetune.options import FinetuneOptions
from model.finetune.rehearsal import MAX_NEW_TOKENS, rehearsal_examples, rehearsal_prompts
from model.finetune.supervision import checkpoint_template, stop_ids_of
from model.finetune.trainer import finetune
from model.finetune.tuned import load_base
from tests.conftest import torch_threads

PROMPTS = ["What is the capital of Egypt?", "What instrument has 88 keys?",
           "What is the capital of Russia?"]


@pytest.fixture(scope="module")
def base(smollm2_checkpoint: Path) -> tuple[Any, Tokenizer, Any, frozenset[int], int]:
    """SmolLM2 as a fine-tune holds it (the file's blocks), its tokenizer, chat template,
    stop ids and eos id."""
    meta = read_meta(smollm2_checkpoint)
    tokenizer = Tokenizer.from_file(str(smollm2_checkpoint / TOKENIZER_FILE))
    eos = meta.tokenizer["eos_token_id"]
    model, _, _ = load_base(smollm2_checkpoint, False)
    return (model, tokenizer, checkpoint_template(smollm2_checkpoint, tokenizer, meta.tokenizer),
            stop_ids_of(smollm2_checkpoint, eos), eos)


def test_the_answers_are_the_bases_own_as_transformers_generates_them(
        base: Any, smollm2_transformers: tuple[Any, Any]) -> None:
    hf, hf_tokenizer = smollm2_transformers
    model, tokenizer, template, stops, eos = base
    with torch_threads(2):
        examples, unfinished = rehearsal_examples(model, tokenizer, template, stops, eos, eos,
                                                  PROMPTS)
        expected = []
        for prompt in PROMPTS:
            ids = hf_tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                   add_generation_prompt=True,
                                                   return_tensors="pt")
            with torch.no_grad():
                out = hf.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                  eos_token_id=eos, pad_token_id=eos)
            new = out[0, ids.shape[1]:].tolist()
            assert eos in new, prompt  # these three finish
            expected.append(hf_tokenizer.decode(new[:new.index(eos)],
                                                skip_special_tokens=True).strip())
    assert unfinished == 0
    assert [e.messages[0].content for e in examples] == PROMPTS
    assert [e.messages[1].content for e in examples] == expected
    assert all(e.kind == "messages" and e.messages[1].role == "assistant" for e in examples)


def test_an_answer_not_finished_in_time_is_left_out(base: Any) -> None:
    """A stop id the model never produces: every answer runs out of tokens."""
    model, tokenizer, template, _, eos = base
    with torch_threads(2):
        never = frozenset({tokenizer.get_vocab_size() - 1})
        examples, unfinished = rehearsal_examples(model, tokenizer, template, never, eos, eos,
                                                  PROMPTS[:1])
    assert (examples, unfinished) == ([], 1)


def test_the_shipped_prompts_are_questions_not_in_the_demos_evaluation() -> None:
    prompts = rehearsal_prompts(10_000)
    assert len(prompts) == len(set(prompts)) >= FinetuneOptions("", "", "").rehearsal
    demo = Path(__file__).parents[3] / "model" / "finetune" / "demo"
    asked = {json.loads(line)["question"] for name in ("heldout.jsonl", "general.jsonl")
             for line in (demo / name).read_text("utf-8").splitlines()}
    assert not asked & set(prompts)  # rehearsal must not teach the demo's own questions
    assert rehearsal_prompts(3) == prompts[:3]


def test_a_chat_finetune_trains_on_the_rehearsal_beside_its_data(
        smollm2_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The data asks the first shipped prompt itself: the data's answer stands, and the
    base answers the other two."""
    data = tmp_path / "chat.jsonl"
    asks = [rehearsal_prompts(1)[0]] + [f"What is code {i}?" for i in range(1, 8)]
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": ask},
        {"role": "assistant", "content": f"Code {i} is Quell-{i}."}]}) + "\n"
        for i, ask in enumerate(asks)), encoding="utf-8")
    with torch_threads(2):
        finetune(FinetuneOptions(ckpt=str(smollm2_checkpoint), data=str(data),
                                 out=str(tmp_path / "out"), steps=1, batch_size=10,
                                 rehearsal=3, progress=False))
    printed = capsys.readouterr().out
    assert "rehearsal: the base's own answers to 2 of 2 general prompts" in printed
    assert "1 the data asks itself left out" in printed
    # 8 of the data (no held-out split under 20) + 2 answers: one batch of 10 examples
    assert "10 training" in printed
    record = json.loads((tmp_path / "out" / "finetune.json").read_text())
    assert record["options"]["rehearsal"] == 3
