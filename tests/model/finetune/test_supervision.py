"""model/finetune/supervision.py: ids and labels checked against masks written out by hand.

A word-level tokenizer built here (one token per word, per whitespace character and per
ChatML special token, a ``<bos>`` added to plain text) makes every expected sequence easy
to write token by token; the real SmolLM2 tokenizer and template are checked against
transformers' ``apply_chat_template`` on the same GGUF file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from model.finetune.examples import DataError, load_examples
from model.finetune.supervision import (
    IGNORE,
    Supervised,
    SupervisionCounts,
    checkpoint_template,
    show_masks,
    stop_ids_of,
    supervise,
)
from service.contract.chat_template import ChatTemplate

WORDS = ["<unk>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>", "\n", " ", "system", "user",
         "assistant", "Be", "brief", "Hi", "Hello", "!", "Bye", "See", "you", "2+2=", "4",
         "one", "two"]
VOCAB = {word: i for i, word in enumerate(WORDS)}
BOS, EOS, IM_END = VOCAB["<bos>"], VOCAB["<eos>"], VOCAB["<|im_end|>"]
STOP = frozenset({IM_END})

CHATML = ("{% for m in messages %}"
          "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + eos_token + '\n' }}"
          "{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

TWO_TURNS = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello !"}, {"role": "user", "content": "Bye"},
             {"role": "assistant", "content": "See you !"}]


def make_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<bos>", "<eos>", "<|im_start|>", "<|im_end|>"])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                       special_tokens=[("<bos>", BOS)])
    return tok


def chatml(source: str = CHATML) -> ChatTemplate:
    return ChatTemplate(source, "test", {"eos_token": "<|im_end|>"})


def prompt(*tokens: str) -> list[tuple[str, bool]]:
    return [(t, False) for t in tokens]


def learn(*tokens: str) -> list[tuple[str, bool]]:
    return [(t, True) for t in tokens]


def ids_labels(expected: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    ids = [VOCAB[t] for t, _ in expected]
    return ids, [VOCAB[t] if on else IGNORE for t, on in expected]


def write_jsonl(path: Path, *lines: Any) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" if x is not None else "\n" for x in lines),
                    encoding="utf-8")
    return path


def run(tmp_path: Path, *lines: Any, template: ChatTemplate | None = None,
        tokenizer: Tokenizer | None = None, eos_id: int | None = EOS,
        max_length: int = 100) -> tuple[list[Supervised], SupervisionCounts]:
    examples = load_examples(write_jsonl(tmp_path / "data.jsonl", *lines))
    return supervise(examples, tokenizer or make_tokenizer(), template or chatml(), STOP,
                     eos_id, max_length)


# the hand-computed mask of TWO_TURNS under CHATML: each answer and its <|im_end|>, not the
# "\n" after it, not the system or user turns, not the "<|im_start|>assistant\n" header
TWO_TURNS_MASK = [
    *prompt("<|im_start|>", "system", "\n", "Be", " ", "brief", "<|im_end|>", "\n",
            "<|im_start|>", "user", "\n", "Hi", "<|im_end|>", "\n",
            "<|im_start|>", "assistant", "\n"),
    *learn("Hello", " ", "!", "<|im_end|>"),
    *prompt("\n", "<|im_start|>", "user", "\n", "Bye", "<|im_end|>", "\n",
            "<|im_start|>", "assistant", "\n"),
    *learn("See", " ", "you", " ", "!", "<|im_end|>"),
    *prompt("\n"),
]


def test_a_two_turn_conversation_supervises_each_answer_and_its_end_of_turn(
        tmp_path: Path) -> None:
    [item], counts = run(tmp_path, {"messages": TWO_TURNS})
    assert (item.ids, item.labels) == ids_labels(TWO_TURNS_MASK)
    assert item.line == 1
    assert counts == SupervisionCounts(kept=1, tokens=38, supervised_tokens=10)
    assert counts.summary() == "examples: 1 kept (38 tokens, 10 supervised)"


def test_conversational_prompt_completion_supervises_only_the_completion(
        tmp_path: Path) -> None:
    [item], _ = run(tmp_path, {"prompt": TWO_TURNS[:4], "completion": TWO_TURNS[4:]})
    expected = [(t, on and i > 30) for i, (t, on) in enumerate(TWO_TURNS_MASK)]
    assert (item.ids, item.labels) == ids_labels(expected)
    assert item.supervised_tokens == 6


def test_prompt_completion_strings_supervise_the_completion_and_eos(tmp_path: Path) -> None:
    items, _ = run(tmp_path, {"prompt": "2+2=", "completion": " 4"},
                   {"prompt": "2+2=", "completion": " 4<eos>"})
    # the prompt gets the tokenizer's <bos> (add_special_tokens=True), the completion none
    expected = [*prompt("<bos>", "2+2="), *learn(" ", "4", "<eos>")]
    assert [(i.ids, i.labels) for i in items] == [ids_labels(expected)] * 2


def test_text_is_supervised_throughout_and_ends_with_eos(tmp_path: Path) -> None:
    [item], counts = run(tmp_path, {"text": "one two"})
    ids = [BOS, VOCAB["one"], VOCAB[" "], VOCAB["two"], EOS]
    assert (item.ids, item.labels) == (ids, ids)
    assert item.supervised_tokens == counts.supervised_tokens == 4  # <bos> predicts nothing


@pytest.mark.parametrize("line", [{"text": "one"}, {"prompt": "2+2=", "completion": "4"}])
def test_text_and_prompt_completion_need_an_eos_id(tmp_path: Path, line: Any) -> None:
    with pytest.raises(ValueError, match="no eos token id"):
        run(tmp_path, line, eos_id=None)


def test_chat_needs_no_eos_id(tmp_path: Path) -> None:
    [item], _ = run(tmp_path, {"messages": TWO_TURNS}, eos_id=None)
    assert (item.ids, item.labels) == ids_labels(TWO_TURNS_MASK)


def test_truncation_and_skips_are_counted(tmp_path: Path) -> None:
    hi = {"role": "user", "content": "Hi"}
    items, counts = run(
        tmp_path,
        {"messages": [hi, {"role": "assistant", "content": "Hello !"}]},  # 14 tokens: cut
        {"messages": TWO_TURNS},  # first answer starts at token 17: nothing left
        {"messages": [hi]},  # no assistant turn: nothing to learn
        {"messages": [hi, {"role": "assistant", "content": "!"}]},  # 12 tokens: fits
        max_length=12)
    first = [*prompt("<|im_start|>", "user", "\n", "Hi", "<|im_end|>", "\n",
                     "<|im_start|>", "assistant", "\n"), *learn("Hello", " ", "!")]
    fourth = [*prompt("<|im_start|>", "user", "\n", "Hi", "<|im_end|>", "\n",
                      "<|im_start|>", "assistant", "\n"), *learn("!", "<|im_end|>"),
              *prompt("\n")]
    assert [(i.line, i.ids, i.labels) for i in items] == [(1, *ids_labels(first)),
                                                          (4, *ids_labels(fourth))]
    assert counts == SupervisionCounts(kept=2, skipped_no_supervised=1, skipped_too_long=1,
                                       truncated=1, tokens=24, supervised_tokens=5)
    assert counts.summary() == (
        "examples: 2 kept (24 tokens, 5 supervised), 1 truncated to max_length, 1 skipped with "
        "no supervised token, 1 skipped with none within max_length")


def test_a_template_that_is_not_prefix_consistent_is_refused_at_the_line(
        tmp_path: Path) -> None:
    counting = chatml("{{ messages | length }}\n" + CHATML)
    path = write_jsonl(tmp_path / "data.jsonl", {"messages": TWO_TURNS[:2]}, None,
                       {"messages": TWO_TURNS})
    with pytest.raises(DataError) as info:
        supervise(load_examples(path), make_tokenizer(), counting, STOP, EOS, 100)
    assert str(info.value) == (
        f"{path}:3: the chat template (test) does not render this conversation as growing "
        "prefixes (at messages[2], an assistant turn), so its tokens cannot be told from the "
        "prompt's")


def test_a_template_refusing_a_conversation_is_refused_at_the_line(tmp_path: Path) -> None:
    strict = chatml("{% if messages[0]['role'] != 'user' %}"
                    "{{ raise_exception('conversations start with a user turn') }}"
                    "{% endif %}" + CHATML)
    path = write_jsonl(tmp_path / "data.jsonl", {"messages": TWO_TURNS[1:3]},
                       {"messages": TWO_TURNS})
    with pytest.raises(DataError) as info:
        supervise(load_examples(path), make_tokenizer(), strict, STOP, EOS, 100)
    assert str(info.value) == (f"{path}:2: the chat template refused the conversation: "
                               "conversations start with a user turn")


def test_eos_stays_supervised_when_it_is_also_the_pad_token(tmp_path: Path) -> None:
    # SmolLM2's case: pad = eos = <|im_end|>; the tokenizer.json also carries padding and
    # truncation settings, which must not leak into the sequences
    tok = make_tokenizer()
    tok.enable_padding(pad_id=IM_END, pad_token="<|im_end|>", length=64)
    tok.enable_truncation(max_length=3)
    items, _ = run(tmp_path, {"messages": TWO_TURNS}, tokenizer=tok, eos_id=IM_END)
    assert [(i.ids, i.labels) for i in items] == [ids_labels(TWO_TURNS_MASK)]
    assert tok.padding is not None and tok.truncation is not None  # the caller's, untouched

    [item], _ = run(tmp_path, {"prompt": "2+2=", "completion": " 4"}, tokenizer=tok,
                    eos_id=IM_END)
    assert item.labels[-1] == item.ids[-1] == IM_END


def test_a_template_without_end_of_turn_tokens_is_counted(tmp_path: Path) -> None:
    plain = chatml("{% for m in messages %}{{ m['role'] + '\n' + m['content'] + '\n' }}"
                   "{% endfor %}{% if add_generation_prompt %}{{ 'assistant\n' }}{% endif %}")
    [item], counts = run(tmp_path, {"messages": TWO_TURNS[1:]}, template=plain)
    expected = [*prompt("user", "\n", "Hi", "\n", "assistant", "\n"),
                *learn("Hello", " ", "!", "\n"),  # no stop token: the whole answer
                *prompt("user", "\n", "Bye", "\n", "assistant", "\n"),
                *learn("See", " ", "you", " ", "!", "\n")]
    assert (item.ids, item.labels) == ids_labels(expected)
    assert counts.no_end_of_turn == 2
    assert counts.summary() == (
        "examples: 1 kept (22 tokens, 10 supervised); assistant turns without an end-of-turn "
        "token: 2 (the model will not learn to stop)")


def test_stop_ids_add_generation_configs_eos_ids(tmp_path: Path) -> None:
    assert stop_ids_of(tmp_path, 2) == {2}
    assert stop_ids_of(tmp_path, None) == frozenset()
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 5}', encoding="utf-8")
    assert stop_ids_of(tmp_path, 2) == {2, 5}
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 2, 9]}',
                                                     encoding="utf-8")
    assert stop_ids_of(tmp_path, 2) == {2, 7, 9}
    assert stop_ids_of(tmp_path, None) == {2, 7, 9}
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": ["x"]}',
                                                     encoding="utf-8")
    with pytest.raises(ValueError, match="eos_token_id holds non-integers"):
        stop_ids_of(tmp_path, 2)


def test_checkpoint_template_gives_the_special_tokens_as_text(tmp_path: Path) -> None:
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}|{{ eos_token }}",
                                                  encoding="utf-8")
    template = checkpoint_template(tmp_path, make_tokenizer(),
                                   {"bos_token_id": BOS, "eos_token_id": IM_END,
                                    "pad_token_id": None})
    assert template.origin == "chat_template.jinja"
    assert template.render([]) == "<bos>|<|im_end|>"


def test_show_masks_marks_what_is_learned(tmp_path: Path) -> None:
    items, _ = run(tmp_path, {"messages": TWO_TURNS[1:3]}, {"messages": TWO_TURNS})
    tok = make_tokenizer()
    assert show_masks(items, tok, 1, color=False) == (
        "--- line 1: 14 tokens, 4 supervised ---\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n⟦Hello !<|im_end|>⟧\n")
    assert show_masks(items, tok, 1, color=True) == (
        "--- line 1: 14 tokens, 4 supervised ---\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        "\x1b[42mHello !<|im_end|>\x1b[0m\n")
    assert show_masks(items, tok, 5, color=False).count("--- line ") == 2


def test_show_masks_does_not_mark_the_first_token_of_a_text(tmp_path: Path) -> None:
    items, _ = run(tmp_path, {"text": "one two"})
    assert show_masks(items, make_tokenizer(), 3, color=False) == (
        "--- line 1: 5 tokens, 4 supervised ---\n<bos>⟦one two<eos>⟧")


def test_show_masks_colours_each_line_of_a_span_apart(tmp_path: Path) -> None:
    plain = chatml("{% for m in messages %}{{ m['role'] + '\n' + m['content'] + '\n' }}"
                   "{% endfor %}{% if add_generation_prompt %}{{ 'assistant\n' }}{% endif %}")
    items, _ = run(tmp_path, {"messages": TWO_TURNS[1:3]}, template=plain)
    assert show_masks(items, make_tokenizer(), 1, color=True) == (
        "--- line 1: 10 tokens, 4 supervised ---\n"
        "user\nHi\nassistant\n\x1b[42mHello !\x1b[0m\n")


def test_smollm2_chat_matches_transformers(smollm2_checkpoint: Path,
                                          smollm2_transformers: tuple[Any, Any],
                                          tmp_path: Path) -> None:
    """The real checkpoint: our ids are what transformers' apply_chat_template gives for the
    same GGUF, the prompt before each answer is what the server would send, and the
    supervised tokens are each answer followed by <|im_end|>."""
    _, reference = smollm2_transformers  # transformers' tokenizer of the same GGUF file
    tokenizer = Tokenizer.from_file(str(smollm2_checkpoint / "tokenizer.json"))
    token_ids = json.loads((smollm2_checkpoint / "config.json").read_text("utf-8"))["tokenizer"]
    template = checkpoint_template(smollm2_checkpoint, tokenizer, token_ids)
    stop_ids = stop_ids_of(smollm2_checkpoint, token_ids["eos_token_id"])
    assert token_ids["pad_token_id"] == token_ids["eos_token_id"]  # pad = eos = <|im_end|>

    messages = [{"role": "user", "content": "What is attention?"},
                {"role": "assistant", "content": "A weighted average of values,\n"
                                                 "weights from query·key scores."},
                {"role": "user", "content": "  And the café's menu? 🍰"},
                {"role": "assistant", "content": " Soup, then cake! 🎂 "}]
    examples = load_examples(write_jsonl(tmp_path / "data.jsonl", {"messages": messages}))
    [item], counts = supervise(examples, tokenizer, template, stop_ids,
                               token_ids["eos_token_id"], 8192)

    assert item.ids == list(reference.apply_chat_template(messages, tokenize=True))
    runs: list[list[int]] = []
    for t, label in enumerate(item.labels):
        if label == IGNORE:
            continue
        assert label == item.ids[t]
        if item.labels[t - 1] == IGNORE:
            runs.append([])
            served = reference.apply_chat_template(messages[:len(runs) * 2 - 1],
                                                   add_generation_prompt=True, tokenize=True)
            assert item.ids[:t] == list(served)  # the prompt the server sends this turn
        runs[-1].append(label)
    assert [reference.decode(r, skip_special_tokens=False) for r in runs] == [
        m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
    assert counts.no_end_of_turn == 0
