"""model/finetune/examples.py: the four TRL SFT formats read from JSONL, and every refusal
pointing at the exact line (path:line: reason) of the first problem in the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from model.finetune.examples import DataError, Example, Message, load_examples

CHAT = {"messages": [{"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": "Hello!"}]}


def write_jsonl(path: Path, *lines: Any) -> Path:
    """Each line a JSON value, or a str written as it is (for broken lines)."""
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n"
                            for x in lines), encoding="utf-8")
    return path


def refusal(path: Path) -> str:
    with pytest.raises(DataError) as info:
        load_examples(path)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_reads_conversational_messages_ignoring_extra_keys(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl",
                       {"id": "a1", "messages": [
                           {"role": "system", "content": "Be brief."},
                           {"role": "user", "content": "Hi", "name": "ann"},
                           {"role": "assistant", "content": "Hello!"}], "source": "x"},
                       {"messages": [{"role": "user", "content": "no answer yet"}]})
    assert load_examples(path) == [
        Example(str(path), 1, "messages",
                messages=(Message("system", "Be brief."), Message("user", "Hi"),
                          Message("assistant", "Hello!"))),
        Example(str(path), 2, "messages", messages=(Message("user", "no answer yet"),)),
    ]


def test_reads_prompt_completion_strings(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl",
                       {"prompt": "2+2=", "completion": " 4", "id": 7})
    assert load_examples(path) == [
        Example(str(path), 1, "prompt_completion", prompt="2+2=", completion=" 4")]


def test_reads_conversational_prompt_completion_as_messages(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", {
        "prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
                   {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"}],
        "completion": [{"role": "assistant", "content": "A2"}]})
    [example] = load_examples(path)
    assert example.kind == "messages"
    assert example.messages == (Message("system", "S"), Message("user", "Q1"),
                                Message("assistant", "A1"), Message("user", "Q2"),
                                Message("assistant", "A2"))
    assert example.supervise_from == 4


def test_messages_win_over_a_prompt_string_kept_beside_them(tmp_path: Path) -> None:
    # ultrachat_200k's rows: {"prompt": str, "prompt_id": str, "messages": [...]}
    path = write_jsonl(tmp_path / "d.jsonl", {"prompt": "Hi", "prompt_id": "x", **CHAT})
    [example] = load_examples(path)
    assert (example.kind, example.supervise_from, len(example.messages)) == ("messages", 0, 2)


def test_reads_text(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", {"text": "one"}, {"text": "two", "meta": {}})
    assert load_examples(path) == [Example(str(path), 1, "text", text="one"),
                                   Example(str(path), 2, "text", text="two")]


def test_blank_lines_are_skipped_and_lines_keep_their_numbers(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(f"\n{json.dumps({'text': 'a'})}\n   \n\r\n{json.dumps({'text': 'b'})}\r\n",
                    encoding="utf-8")
    assert [(e.line, e.text) for e in load_examples(path)] == [(2, "a"), (5, "b")]


def test_a_utf8_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "é"}).encode() + b"\n")
    assert [e.text for e in load_examples(path)] == ["é"]


@pytest.mark.parametrize(("bad", "reason"), [
    ("{not json", "not valid JSON (Expecting property name enclosed in double quotes at "
                  "column 2)"),
    ("[1, 2]", "not a JSON object (a JSON array)"),
    ('"hello"', "not a JSON object (a JSON string)"),
    ({"id": 3}, "has no 'messages', 'prompt'/'completion' or 'text' key (keys: 'id')"),
    ({"messages": []}, "'messages' must be a non-empty list of messages"),
    ({"messages": "Hi"}, "'messages' must be a non-empty list of messages"),
    ({"messages": ["Hi"]},
     "messages[0] is not an object with a string 'role' and a string 'content'"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]},
     "messages[1] is not an object with a string 'role' and a string 'content'"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": 1, "content": "x"}]},
     "messages[1] is not an object with a string 'role' and a string 'content'"),
    ({"messages": [{"role": "tool", "content": "42"}]},
     "messages[0] has unknown role 'tool' (allowed: system, user, assistant)"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " \n"}]},
     "messages[1] is an assistant message with empty content"),
    ({"messages": [{"role": "user", "content": "Hi"}], "completion": "x"},
     "holds both 'messages' and 'completion': which one to train on is ambiguous"),
])
def test_a_bad_messages_line_is_refused_with_its_line(tmp_path: Path, bad: Any,
                                                      reason: str) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", CHAT, CHAT, bad, {"messages": "also bad"})
    assert refusal(path) == f"{path}:3: {reason}"


@pytest.mark.parametrize(("bad", "reason"), [
    ({"prompt": "", "completion": "x"}, "'prompt' must be a non-empty string"),
    ({"prompt": "q", "completion": "  "}, "'completion' must be a non-empty string"),
    ({"prompt": "q", "completion": 3}, "'completion' must be a non-empty string"),
    ({"prompt": "q", "completion": [{"role": "assistant", "content": "a"}]},
     "'completion' must be a non-empty string"),
    ({"prompt": "q"}, "has no 'completion' (prompt/completion examples need both)"),
    ({"completion": "a"}, "has no 'prompt' (prompt/completion examples need both)"),
])
def test_a_bad_prompt_completion_line_is_refused_with_its_line(tmp_path: Path, bad: Any,
                                                               reason: str) -> None:
    good = {"prompt": "q", "completion": "a"}
    path = write_jsonl(tmp_path / "d.jsonl", good, good, bad)
    assert refusal(path) == f"{path}:3: {reason}"


@pytest.mark.parametrize(("bad", "reason"), [
    ({"prompt": [{"role": "user", "content": "q"}], "completion": []},
     "'completion' must be a non-empty list of messages"),
    ({"prompt": [{"role": "user", "content": "q"}], "completion": "a"},
     "'completion' must be a non-empty list of messages"),
    ({"prompt": [], "completion": [{"role": "assistant", "content": "a"}]},
     "'prompt' must be a non-empty list of messages"),
    ({"prompt": [{"role": "user", "content": "q"}],
      "completion": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]},
     "completion[1] has role 'user'; a completion holds only assistant messages"),
    ({"prompt": [{"role": "user", "content": "q"}],
      "completion": [{"role": "assistant", "content": ""}]},
     "completion[0] is an assistant message with empty content"),
    ({"prompt": [{"role": "robot", "content": "q"}],
      "completion": [{"role": "assistant", "content": "a"}]},
     "prompt[0] has unknown role 'robot' (allowed: system, user, assistant)"),
])
def test_a_bad_conversational_prompt_completion_line_is_refused(tmp_path: Path, bad: Any,
                                                                reason: str) -> None:
    good = {"prompt": [{"role": "user", "content": "q"}],
            "completion": [{"role": "assistant", "content": "a"}]}
    path = write_jsonl(tmp_path / "d.jsonl", good, good, bad)
    assert refusal(path) == f"{path}:3: {reason}"


def test_an_empty_text_is_refused(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", {"text": "a"}, {"text": "b"}, {"text": "\t"})
    assert refusal(path) == f"{path}:3: 'text' must be a non-empty string"


@pytest.mark.parametrize(("second", "name"), [
    ({"prompt": "q", "completion": "a"}, "prompt/completion"),
    ({"prompt": [{"role": "user", "content": "q"}],
      "completion": [{"role": "assistant", "content": "a"}]}, "conversational prompt/completion"),
    ({"text": "t"}, "text"),
])
def test_a_file_mixing_formats_is_refused_naming_both(tmp_path: Path, second: Any,
                                                      name: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(f"\n{json.dumps(CHAT)}\n{json.dumps(CHAT)}\n{json.dumps(second)}\n",
                    encoding="utf-8")
    assert refusal(path) == (f"{path}:4: a {name} example in a file of messages examples "
                             "(line 2); one format per file")


def test_string_and_conversational_prompts_do_not_mix(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", {"prompt": "q", "completion": "a"},
                       {"prompt": [{"role": "user", "content": "q"}],
                        "completion": [{"role": "assistant", "content": "a"}]})
    assert refusal(path).startswith(f"{path}:2: a conversational prompt/completion example in "
                                    "a file of prompt/completion examples (line 1)")


def test_the_first_problem_in_file_order_is_reported(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", CHAT,
                       {"messages": [{"role": "user", "content": "Hi"},
                                     {"role": "assistant", "content": ""}]},
                       "{broken", {"text": "other format"})
    assert refusal(path).startswith(f"{path}:2: messages[1] is an assistant message")


def test_a_file_that_is_not_utf8_is_refused_at_the_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(json.dumps(CHAT).encode() + b'\n{"text": "caf\xe9"}\n')
    assert refusal(path) == f"{path}:2: not UTF-8 text (byte 0xe9 cannot be decoded)"


def test_an_unreadable_file_is_refused_with_its_path(tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"
    assert refusal(missing) == f"{missing}: cannot read the data set: No such file or directory"
    assert refusal(tmp_path).startswith(f"{tmp_path}: cannot read the data set: ")


@pytest.mark.parametrize("content", ["", "\n  \n\n"])
def test_a_file_without_examples_is_refused(tmp_path: Path, content: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(content, encoding="utf-8")
    assert refusal(path) == f"{path}: no examples (the file is empty or holds only blank lines)"


def test_data_error_is_a_value_error_with_its_parts(tmp_path: Path) -> None:
    error = DataError("d.jsonl", 3, "bad\nthing")
    assert isinstance(error, ValueError)
    assert (str(error), error.source, error.line, error.reason) == (
        "d.jsonl:3: bad thing", "d.jsonl", 3, "bad thing")
