"""Reading a fine-tuning data set: JSONL in the formats TRL's SFTTrainer reads.

One JSON object per line, one format per file (the first example decides):

- conversational ``{"messages": [{"role", "content"}, ...]}``
- prompt/completion ``{"prompt": str, "completion": str}``
- conversational prompt/completion ``{"prompt": [messages], "completion": [messages]}``,
  read as one conversation whose leading ``prompt`` messages are never supervised
- language modelling ``{"text": str}``

Other keys are ignored (data sets often carry ids), as are message keys other than
``role`` and ``content``; an object with ``messages`` is conversational even when it also
holds a ``prompt`` string (ultrachat does). A line is refused (``DataError``, one line
``path:line: reason``) before anything is tokenized, so a bad data set fails in a second
rather than an hour into training; the first problem in file order is the one reported.
A conversation without an assistant turn is valid: it has nothing to learn and is
skipped, with a count, when it is tokenized (model/finetune/supervision.py).
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Kind = Literal["messages", "prompt_completion", "text"]
ROLES = ("system", "user", "assistant")

# Format names as the error messages say them; the conversational prompt/completion
# format is its own format (a file mixing it with string prompts is refused) but is read
# as kind "messages".
MESSAGES = "messages"
PROMPT_COMPLETION = "prompt/completion"
CHAT_PROMPT_COMPLETION = "conversational prompt/completion"
TEXT = "text"


_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


class DataError(ValueError):
    """A data set we refuse; the message is one line, ``path:line: reason`` (``path:
    reason`` for a problem of the whole file), so an editor can jump to it."""

    def __init__(self, source: str, line: int | None, reason: str) -> None:
        self.source, self.line = source, line
        self.reason = " ".join(reason.splitlines())
        where = source if line is None else f"{source}:{line}"
        super().__init__(f"{where}: {self.reason}")


class _Refused(Exception):
    """A reason to refuse the line being read (load_examples adds where it is)."""


@dataclass(frozen=True)
class Message:
    role: str  # one of ROLES
    content: str


@dataclass(frozen=True)
class Example:
    """One line of the data set; which content fields are set depends on ``kind``."""

    source: str  # the file it came from, for error messages
    line: int  # 1-based line number in that file
    kind: Kind
    messages: tuple[Message, ...] = ()  # kind "messages"
    supervise_from: int = 0  # leading messages that are prompt only (never supervised)
    prompt: str = ""  # kind "prompt_completion"
    completion: str = ""
    text: str = ""  # kind "text"


def _format_of(obj: dict[str, Any]) -> str:
    if "messages" in obj:
        if "completion" in obj:
            raise _Refused("holds both 'messages' and 'completion': which one to train on "
                           "is ambiguous")
        return MESSAGES
    if "prompt" in obj or "completion" in obj:
        missing = "completion" if "prompt" in obj else "prompt"
        if missing not in obj:
            raise _Refused(f"has no '{missing}' (prompt/completion examples need both)")
        return CHAT_PROMPT_COMPLETION if isinstance(obj["prompt"], list) else PROMPT_COMPLETION
    if "text" in obj:
        return TEXT
    keys = ", ".join(repr(k) for k in list(obj)[:5]) or "none"
    raise _Refused(f"has no 'messages', 'prompt'/'completion' or 'text' key (keys: {keys})")


def _message(value: Any, where: str, roles: tuple[str, ...] = ROLES) -> Message:
    if not (isinstance(value, dict) and isinstance(value.get("role"), str)
            and isinstance(value.get("content"), str)):
        raise _Refused(f"{where} is not an object with a string 'role' and a string 'content'")
    role, content = value["role"], value["content"]
    if role not in ROLES:
        raise _Refused(f"{where} has unknown role {role!r} (allowed: {', '.join(ROLES)})")
    if role not in roles:
        raise _Refused(f"{where} has role {role!r}; a completion holds only assistant "
                       "messages")
    if role == "assistant" and not content.strip():
        raise _Refused(f"{where} is an assistant message with empty content")
    return Message(role, content)


def _messages(value: Any, key: str, roles: tuple[str, ...] = ROLES) -> tuple[Message, ...]:
    if not isinstance(value, list) or not value:
        raise _Refused(f"'{key}' must be a non-empty list of messages")
    return tuple(_message(m, f"{key}[{i}]", roles) for i, m in enumerate(value))


def _string(obj: dict[str, Any], key: str) -> str:
    value = obj[key]
    if not isinstance(value, str) or not value.strip():
        raise _Refused(f"'{key}' must be a non-empty string")
    return value


def _example(source: str, line: int, fmt: str, obj: dict[str, Any]) -> Example:
    if fmt == MESSAGES:
        return Example(source, line, "messages", messages=_messages(obj["messages"], "messages"))
    if fmt == CHAT_PROMPT_COMPLETION:
        prompt = _messages(obj["prompt"], "prompt")
        completion = _messages(obj["completion"], "completion", roles=("assistant",))
        return Example(source, line, "messages", messages=prompt + completion,
                       supervise_from=len(prompt))
    if fmt == PROMPT_COMPLETION:
        return Example(source, line, "prompt_completion", prompt=_string(obj, "prompt"),
                       completion=_string(obj, "completion"))
    return Example(source, line, "text", text=_string(obj, "text"))


def load_examples(path: str | Path) -> list[Example]:
    """Every example of a JSONL file, or DataError for its first bad line."""
    source = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise DataError(source, None, f"cannot read the data set: {exc.strerror or exc}") from exc
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise DataError(source, line, f"not UTF-8 text (byte 0x{data[exc.start]:02x} "
                                      f"cannot be decoded)") from exc

    examples: list[Example] = []
    first: tuple[str, int] | None = None  # the file's format and the line that set it
    # split on "\n" only: str.splitlines would also split at U+2028 inside a JSON string
    for number, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        try:
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise _Refused(f"not valid JSON ({exc.msg} at column {exc.colno})") from exc
            if not isinstance(obj, dict):
                raise _Refused(f"not a JSON object (a JSON {_JSON_TYPES.get(type(obj), 'value')})")
            fmt = _format_of(obj)
            if first is None:
                first = (fmt, number)
            elif fmt != first[0]:
                raise _Refused(f"a {fmt} example in a file of {first[0]} examples (line "
                               f"{first[1]}); one format per file")
            examples.append(_example(source, number, fmt, obj))
        except _Refused as exc:
            raise DataError(source, number, str(exc)) from None
    if not examples:
        raise DataError(source, None, "no examples (the file is empty or holds only blank "
                                      "lines)")
    return examples
