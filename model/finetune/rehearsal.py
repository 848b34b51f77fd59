"""Self-rehearsal: the base model's own answers to general prompts, trained beside the data.

A few dozen conversations about one subject pull a small model's other answers toward that
subject: SmolLM2-135M-Instruct fine-tuned on 50 lines about an invented company answered
"The capital of France is Lumenthra." (its instrument), at lr 1e-3 and at 5e-4 alike.
Training on the base's own greedy answers to unrelated prompts as well anchors those
answers where they were (self-synthesized rehearsal, Huang et al., ACL 2024): on that set
the same run kept all eight general answers and learned all ten held-out facts
(docs/training.md). The answers are the base's, right or wrong: the point is to keep the
model as it was outside the new data, not to teach it anything.

The prompts (rehearsal_prompts.txt) are everyday questions and small tasks; a prompt the
data asks itself is the data's to answer (the trainer leaves it out), and an answer the
base does not finish within ``MAX_NEW_TOKENS`` is left out (a cut answer would teach
stopping mid-sentence). Greedy, so the examples are a function of the checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from model.finetune.examples import Example, Message
from model.sample import generate
from service.contract.chat_template import ChatTemplate

PROMPTS_FILE = Path(__file__).with_name("rehearsal_prompts.txt")
MAX_NEW_TOKENS = 96
SOURCE = "rehearsal"  # Example.source of the generated examples


def rehearsal_prompts(count: int) -> list[str]:
    """The first ``count`` shipped prompts."""
    lines = PROMPTS_FILE.read_text("utf-8").splitlines()
    return [line.strip() for line in lines if line.strip()][:count]


@torch.no_grad()
def rehearsal_examples(model: Any, tokenizer: Tokenizer, template: ChatTemplate,
                       stop_ids: frozenset[int], eos_id: int | None, pad_id: int,
                       prompts: list[str]) -> tuple[list[Example], int]:
    """(one chat example per prompt the base answers within MAX_NEW_TOKENS, how many it
    left unfinished). ``model``: the base GPT (an adapter wired in must be zero, as a fresh
    LoRA's B is); generated in one left-padded batch."""
    if not prompts or not stop_ids:
        return [], len(prompts)
    encoded = [tokenizer.encode(template.render([{"role": "user", "content": p}],
                                                add_generation_prompt=True),
                                add_special_tokens=False).ids for p in prompts]
    width = max(len(ids) for ids in encoded)
    ids = torch.tensor([[pad_id] * (width - len(e)) + e for e in encoded])  # (B, T)
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])  # (B, T)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        out = generate(model, ids.to(device), MAX_NEW_TOKENS, attention_mask=mask.to(device),
                       greedy=True, eos_token_id=eos_id if eos_id is not None else min(stop_ids),
                       pad_token_id=pad_id)
    finally:
        model.train(was_training)
    examples, unfinished = [], 0
    for i, (prompt, row) in enumerate(zip(prompts, out.sequences[:, width:].tolist(), strict=True)):
        end = next((j for j, t in enumerate(row) if t in stop_ids), None)
        answer = tokenizer.decode(row[:end], skip_special_tokens=True).strip() \
            if end is not None else ""
        if not answer:
            unfinished += 1
            continue
        examples.append(Example(SOURCE, i + 1, "messages", (
            Message("user", prompt), Message("assistant", answer))))
    return examples, unfinished
