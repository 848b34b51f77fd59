"""Chat templates render exactly as transformers' apply_chat_template renders them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from service.artifact.chat_template import DEFAULT_TEMPLATE, ChatTemplate, ChatTemplateError

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA3 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('Only user and assistant roles follow the system message') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""  # noqa: E501

# trim_blocks / lstrip_blocks matter here, plus tojson, loop controls and a generation block.
BLOCKY = """{% for message in messages %}
    {% if message.role == 'system' %}
        {% continue %}
    {% endif %}
    [{{ message.role | upper }}] {{ message | tojson }}
    {% generation %}{{ message.content }}{% endgeneration %}
{% endfor %}
{% if add_generation_prompt %}{{ eos_token }}>>{% endif %}
"""

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello there!"}],
    [{"role": "system", "content": "  Be brief. "},
     {"role": "user", "content": "What is <b>2+2</b>?"},
     {"role": "assistant", "content": "4 — «four»"},
     {"role": "user", "content": "And 3+3?\n"}],
]


def hf_tokenizer(template: str) -> Any:
    transformers = pytest.importorskip("transformers")
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "hello": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        chat_template=template)


def write_config(directory: Path, **config: Any) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer_config.json").write_text(json.dumps(config), "utf-8")
    return directory


@pytest.mark.parametrize("name,template", [("chatml", CHATML), ("llama3", LLAMA3),
                                           ("blocky", BLOCKY)])
def test_rendering_equals_transformers(name: str, template: str, tmp_path: Path) -> None:
    tokenizer = hf_tokenizer(template)
    ours = ChatTemplate.load(write_config(tmp_path, bos_token="<s>", eos_token="</s>",
                                          chat_template=template), {})
    assert ours.origin == "tokenizer_config.json"
    for messages in CONVERSATIONS:
        for add in (True, False):
            expected = tokenizer.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=add)
            assert ours.render(messages, add_generation_prompt=add) == expected, name


def test_chat_template_jinja_wins_over_the_config_field(tmp_path: Path) -> None:
    write_config(tmp_path, chat_template=CHATML,
                 eos_token={"content": "</s>", "special": True})  # AddedToken form
    (tmp_path / "chat_template.jinja").write_text(LLAMA3, "utf-8")
    template = ChatTemplate.load(tmp_path, {"bos_token": "<start>"})
    assert template.origin == "chat_template.jinja"
    expected = hf_tokenizer(LLAMA3).apply_chat_template(
        CONVERSATIONS[1], tokenize=False, add_generation_prompt=True)
    assert template.render(CONVERSATIONS[1]) == expected.replace("<s>", "<start>", 1)
    assert template.special_tokens["eos_token"] == "</s>"
    # An artifact only reads the files its manifest pins.
    assert ChatTemplate.load(tmp_path, {}, listed=["tokenizer_config.json"]).source == CHATML


def test_named_templates_pick_default_and_no_template_gets_chatml(tmp_path: Path) -> None:
    write_config(tmp_path / "named", chat_template=[
        {"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": LLAMA3}])
    assert ChatTemplate.load(tmp_path / "named", {}).source == LLAMA3
    bare = ChatTemplate.load(tmp_path / "bare", {})
    assert bare.origin == "default" and bare.source == DEFAULT_TEMPLATE
    assert bare.render([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_raise_exception_and_sandbox_violations_are_template_errors(tmp_path: Path) -> None:
    template = ChatTemplate.load(write_config(tmp_path, chat_template=LLAMA3), {})
    with pytest.raises(ChatTemplateError, match="Only user and assistant"):
        template.render([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}])
    escape = ChatTemplate("{{ messages.__class__.__mro__ }}", "test", {})
    with pytest.raises(ChatTemplateError):
        escape.render([{"role": "user", "content": "a"}])
    mutate = ChatTemplate("{% set _ = messages.append(1) %}", "test", {})
    with pytest.raises(ChatTemplateError):
        mutate.render([{"role": "user", "content": "a"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate.load(write_config(tmp_path / "broken", chat_template="{% for %}"), {})
