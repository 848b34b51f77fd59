"""Chat templates: a conversation → the prompt text, rendered the way transformers does.

The template comes from the artifact: ``chat_template.jinja`` (current Hugging Face
snapshots), else the ``chat_template`` field of ``tokenizer_config.json`` (older ones; a
list of named templates picks ``default``). A model without one gets DEFAULT_TEMPLATE,
ChatML's layout as plain text. Rendering matches ``apply_chat_template``: a sandboxed,
immutable Jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``, the loop-controls
extension, ``raise_exception``, ``strftime_now``, a ``tojson`` that does not escape HTML,
a no-op ``{% generation %}`` block, and the special tokens (``bos_token``, ``eos_token``,
...) as variables.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from service.contract.io_spec import CHAT_TEMPLATE_FILE as TEMPLATE_FILE
from service.contract.io_spec import TOKENIZER_CONFIG_FILE

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                      "cls_token", "mask_token")

# ChatML's turns ("<|im_start|>role\ncontent<|im_end|>\n"), used when the model has no
# template; for a tokenizer without those special tokens they are ordinary text.
DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template refused the conversation (raise_exception) or failed to render."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant text with
    it for training masks; for rendering it is transparent."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's API

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(
            lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (cached: a server renders one template all its life)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    origin: str  # "chat_template.jinja", "tokenizer_config.json" or "default"
    special_tokens: Mapping[str, str]

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               extra: Mapping[str, Any] | None = None) -> str:
        variables = {**self.special_tokens, **(extra or {})}
        try:
            return compile_template(self.source).render(
                messages=list(messages), tools=None, documents=None,
                add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(str(exc)) from exc

    @classmethod
    def load(cls, directory: Path, fallback_tokens: Mapping[str, str],
             listed: Sequence[str] | None = None) -> ChatTemplate:
        """The template of an artifact (or a checkpoint) directory, or the default one.

        ``fallback_tokens`` (from the tokenizer) fill in special tokens that
        tokenizer_config.json does not name; with ``listed`` (the manifest's files), a file
        the manifest does not pin is not read. A template that does not compile raises
        ChatTemplateError.
        """
        def present(name: str) -> bool:
            return (directory / name).is_file() and (listed is None or name in listed)

        config: dict[str, Any] = {}
        config_path = directory / TOKENIZER_CONFIG_FILE
        if present(TOKENIZER_CONFIG_FILE):
            config = json.loads(config_path.read_text("utf-8"))
        tokens = dict(fallback_tokens)
        for key in SPECIAL_TOKEN_KEYS:
            value = config.get(key)
            if isinstance(value, dict):  # AddedToken form {"content": ..., ...}
                value = value.get("content")
            if isinstance(value, str):
                tokens[key] = value
        source, origin = config.get("chat_template"), TOKENIZER_CONFIG_FILE
        if present(TEMPLATE_FILE):
            source, origin = (directory / TEMPLATE_FILE).read_text("utf-8"), TEMPLATE_FILE
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str):
            source, origin = DEFAULT_TEMPLATE, "default"
        try:
            compile_template(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"{origin}: the chat template does not compile: "
                                    f"{exc}") from exc
        return cls(source, origin, tokens)
