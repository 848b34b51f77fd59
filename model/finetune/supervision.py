"""Token ids and labels per example: which tokens the model learns to say.

``labels[t]`` is ``ids[t]`` where the loss applies and IGNORE (-100) elsewhere; they are
not shifted (the trainer scores position t's logits against ``labels[t + 1]``), so
``labels[0]`` is never scored, whatever it holds: text examples keep ``labels == ids``
everywhere, and every count of supervised tokens here counts positions 1 onwards.

Chat examples are masked by rendering the checkpoint's own chat template on growing
prefixes, so no ``{% generation %}`` markers are needed (stock templates lack them). For
assistant message i, ``render(messages[:i], add_generation_prompt=True)`` is exactly the
prompt the server sends for that turn; the rendered conversation is cut at those
boundaries and each piece tokenized on its own (``add_special_tokens=False``, as the
server encodes a rendered prompt), so the assistant's tokens are the ones it would
generate after that prompt. An assistant piece is supervised up to and including its
first end-of-turn token: the model learns to stop, even when pad == eos (trl#1623); what
the template adds after it (ChatML's "\\n") is not the model's to say.

Prompt/completion strings follow the server's plain prompts: the prompt encoded with the
tokenizer's special tokens (``add_special_tokens=True``), the completion after it without,
then EOS. Torch-free, so ``attnserve finetune --show-masks`` answers at once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from model.finetune.examples import DataError, Example
from service.contract.chat_template import ChatTemplate, ChatTemplateError

IGNORE = -100  # the label of a position the loss skips (PyTorch's ignore_index)
GENERATION_CONFIG_FILE = "generation_config.json"
MARK_COLOR = ("\x1b[42m", "\x1b[0m")  # green background
MARK_PLAIN = ("⟦", "⟧")


@dataclass(frozen=True)
class Supervised:
    line: int  # the example's line in its data set
    ids: list[int]
    labels: list[int]  # same length as ids; IGNORE where nothing is learned

    @property
    def supervised_tokens(self) -> int:
        """Positions the loss scores (position 0 has no prediction before it)."""
        return sum(1 for label in self.labels[1:] if label != IGNORE)


@dataclass
class SupervisionCounts:
    kept: int = 0
    skipped_no_supervised: int = 0  # nothing to learn (a conversation without an answer)
    skipped_too_long: int = 0  # every supervised token lay past max_length
    truncated: int = 0  # kept, cut to max_length
    no_end_of_turn: int = 0  # assistant turns (of kept examples) without a stop token
    tokens: int = 0  # of kept examples
    supervised_tokens: int = 0

    def summary(self) -> str:
        parts = [f"examples: {self.kept} kept ({self.tokens} tokens, {self.supervised_tokens} "
                 "supervised)"]
        if self.truncated:
            parts.append(f"{self.truncated} truncated to max_length")
        if self.skipped_no_supervised:
            parts.append(f"{self.skipped_no_supervised} skipped with no supervised token")
        if self.skipped_too_long:
            parts.append(f"{self.skipped_too_long} skipped with none within max_length")
        line = ", ".join(parts)
        if self.no_end_of_turn:
            line += (f"; assistant turns without an end-of-turn token: {self.no_end_of_turn} "
                     "(the model will not learn to stop)")
        return line


def stop_ids_of(ckpt_dir: Path, eos_token_id: int | None) -> frozenset[int]:
    """The tokens that end an assistant turn: the checkpoint's eos and the eos_token_id
    (an int or a list, Llama 3 lists <|eot_id|> too) of generation_config.json, the ids the
    server stops on."""
    ids = set() if eos_token_id is None else {eos_token_id}
    path = Path(ckpt_dir) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return frozenset(ids)
    try:
        data = json.loads(path.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it as JSON: {exc}") from exc
    value = data.get("eos_token_id") if isinstance(data, dict) else None
    listed = [value] if isinstance(value, int) else value if isinstance(value, list) else []
    bad = [v for v in listed if not isinstance(v, int) or isinstance(v, bool)]
    if bad:
        raise ValueError(f"{path}: eos_token_id holds non-integers {bad}")
    return frozenset(ids | set(listed))


def checkpoint_template(ckpt_dir: Path, tokenizer: Tokenizer,
                        token_ids: Mapping[str, Any]) -> ChatTemplate:
    """The checkpoint's chat template with the special-token variables the server gives it
    (service/artifact/loader.py: bos/eos/pad as text), so training renders a conversation
    exactly as serving will. ``token_ids``: config.json's tokenizer section."""
    specials = {}
    for name in ("bos_token", "eos_token", "pad_token"):
        token_id = token_ids.get(f"{name}_id")
        if isinstance(token_id, int):
            added = tokenizer.get_added_tokens_decoder().get(token_id)
            if added is not None and added.special:
                specials[name] = added.content
            else:
                specials[name] = tokenizer.decode([token_id], skip_special_tokens=False)
    return ChatTemplate.load(Path(ckpt_dir), specials)


def _plain(tokenizer: Tokenizer) -> Tokenizer:
    """The tokenizer without padding or truncation settings (a tokenizer.json may carry
    them): either would put pads inside a sequence or cut a piece of it."""
    if tokenizer.padding is None and tokenizer.truncation is None:
        return tokenizer
    plain = Tokenizer.from_str(tokenizer.to_str())
    plain.no_padding()
    plain.no_truncation()
    return plain


def _chat(example: Example, tokenizer: Tokenizer, template: ChatTemplate,
          stop_ids: frozenset[int]) -> tuple[list[int], list[int], int]:
    """ids, labels and the number of assistant turns without an end-of-turn token."""
    messages = [{"role": m.role, "content": m.content} for m in example.messages]
    turns = [i for i, m in enumerate(example.messages)
             if m.role == "assistant" and i >= example.supervise_from]
    try:
        full = template.render(messages, add_generation_prompt=False)
        cuts: list[int] = []  # start and end of each assistant span in full
        for i in turns:
            before = template.render(messages[:i], add_generation_prompt=True)
            after = template.render(messages[:i + 1], add_generation_prompt=False)
            if not (after.startswith(before) and full.startswith(after)):
                raise DataError(example.source, example.line, (
                    f"the chat template ({template.origin}) does not render this "
                    f"conversation as growing prefixes (at messages[{i}], an assistant turn), "
                    "so its tokens cannot be told from the prompt's"))
            cuts += [len(before), len(after)]
    except ChatTemplateError as exc:
        raise DataError(example.source, example.line,
                        f"the chat template refused the conversation: {exc}") from exc
    bounds = [0, *cuts, len(full)]  # both are prefixes of full: bounds never decrease
    ids: list[int] = []
    labels: list[int] = []
    no_end = 0
    for k in range(len(bounds) - 1):
        piece = tokenizer.encode(full[bounds[k]:bounds[k + 1]], add_special_tokens=False).ids
        ids += piece
        if k % 2 == 0:  # prompt, template text, or what follows the last answer
            labels += [IGNORE] * len(piece)
            continue
        end = next((j for j, t in enumerate(piece) if t in stop_ids), None)
        if end is None:
            no_end += 1
            labels += piece
        else:
            labels += piece[:end + 1] + [IGNORE] * (len(piece) - end - 1)
    return ids, labels, no_end


def _prompt_completion(example: Example, tokenizer: Tokenizer,
                       eos_id: int) -> tuple[list[int], list[int]]:
    prompt = tokenizer.encode(example.prompt, add_special_tokens=True).ids
    completion = tokenizer.encode(example.completion, add_special_tokens=False).ids
    if not completion or completion[-1] != eos_id:
        completion.append(eos_id)
    return prompt + completion, [IGNORE] * len(prompt) + completion


def _text(example: Example, tokenizer: Tokenizer, eos_id: int) -> tuple[list[int], list[int]]:
    ids = tokenizer.encode(example.text, add_special_tokens=True).ids
    if not ids or ids[-1] != eos_id:
        ids.append(eos_id)
    return ids, list(ids)  # labels[0] too: never scored (nothing predicts it)


def supervise(examples: Sequence[Example], tokenizer: Tokenizer, template: ChatTemplate,
              stop_ids: frozenset[int], eos_id: int | None,
              max_length: int) -> tuple[list[Supervised], SupervisionCounts]:
    """Every example's ids and labels, cut to ``max_length``; examples left with nothing
    to learn are skipped and counted. DataError names the line of a conversation the
    template cannot render as growing prefixes (or refuses)."""
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2 (one token predicts the next), "
                         f"got {max_length}")
    if eos_id is None and any(e.kind != "messages" for e in examples):
        raise ValueError("the tokenizer has no eos token id: text and prompt/completion "
                         "examples need one to end each sequence")
    tokenizer = _plain(tokenizer)
    out: list[Supervised] = []
    counts = SupervisionCounts()
    for example in examples:
        no_end = 0
        if example.kind == "messages":
            ids, labels, no_end = _chat(example, tokenizer, template, stop_ids)
        elif example.kind == "prompt_completion":
            assert eos_id is not None
            ids, labels = _prompt_completion(example, tokenizer, eos_id)
        else:
            assert eos_id is not None
            ids, labels = _text(example, tokenizer, eos_id)
        item = Supervised(example.line, ids, labels)
        if item.supervised_tokens == 0:
            counts.skipped_no_supervised += 1
            continue
        if len(ids) > max_length:
            item = Supervised(example.line, ids[:max_length], labels[:max_length])
            if item.supervised_tokens == 0:
                counts.skipped_too_long += 1
                continue
            counts.truncated += 1
        counts.kept += 1
        counts.no_end_of_turn += no_end
        counts.tokens += len(item.ids)
        counts.supervised_tokens += item.supervised_tokens
        out.append(item)
    return out, counts


def show_masks(supervised: Sequence[Supervised], tokenizer: Tokenizer, n: int,
               color: bool) -> str:
    """The first n sequences as text with the supervised spans marked (green background,
    or between ⟦ and ⟧), special tokens shown, to check what the model will learn."""
    start_mark, end_mark = MARK_COLOR if color else MARK_PLAIN
    blocks = []
    for item in supervised[:n]:
        marked = [t > 0 and label != IGNORE for t, label in enumerate(item.labels)]
        bounds = [0, *(t for t in range(1, len(marked)) if marked[t] != marked[t - 1]),
                  len(marked)]
        # decode growing prefixes and take differences: decoding a run on its own could
        # drop a leading space (sentencepiece) or split a UTF-8 character (byte-level BPE)
        prefixes = [tokenizer.decode(item.ids[:b], skip_special_tokens=False) for b in bounds]
        text = ""
        for k in range(len(bounds) - 1):
            a, b = bounds[k], bounds[k + 1]
            piece = (prefixes[k + 1][len(prefixes[k]):]
                     if prefixes[k + 1].startswith(prefixes[k])
                     else tokenizer.decode(item.ids[a:b], skip_special_tokens=False))
            if marked[a] and color:  # colour each line apart: terminals paint past a "\n"
                piece = "\n".join(f"{start_mark}{x}{end_mark}" if x else ""
                                  for x in piece.split("\n"))
            elif marked[a]:
                piece = f"{start_mark}{piece}{end_mark}"
            text += piece
        blocks.append(f"--- line {item.line}: {len(item.ids)} tokens, "
                      f"{item.supervised_tokens} supervised ---\n{text}")
    return "\n".join(blocks)
