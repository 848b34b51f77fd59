"""Chat templates render exactly as transformers' apply_chat_template renders them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from service.contract.chat_template import DEFAULT_TEMPLATE, ChatTemplate, ChatTemplateError

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


# Written for these tests in the manner of Qwen3's and Gemma 3's templates: namespace(),
# a reversed loop, tool calls and tool turns, reasoning split off at </think>, the
# enable_thinking switch (vLLM's chat_template_kwargs), and Gemma's alternation check and
# system text folded into the first user turn.
THINKING = """{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if message.role == "user" and message.content is string %}
        {%- set ns.last_query = index %}{% break %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "assistant" %}
        {%- set reasoning = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if loop.index0 > ns.last_query and reasoning %}
            {{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- content }}
        {%- for call in message.tool_calls or [] %}
            {{- '\\n<tool_call>\\n' + call.function | tojson + '\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or messages[loop.index0 - 1].role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""  # noqa: E501

GEMMA_STYLE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] | trim + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"""

AGENT_TURNS: list[dict[str, Any]] = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "<think>\nneed a tool\n</think>\n\n", "tool_calls": [
        {"function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "18 °C, sun"},
    {"role": "tool", "content": "wind 5 km/h"},
    {"role": "assistant", "content": "<think>\nsummarise\n</think>\n\nSunny, 18 °C."},
    {"role": "user", "content": "And tomorrow?"},
]


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
def test_thinking_and_tool_turns_render_as_transformers(kwargs: dict[str, Any],
                                                        tmp_path: Path) -> None:
    tokenizer = hf_tokenizer(THINKING)
    ours = ChatTemplate.load(write_config(tmp_path, chat_template=THINKING), {})
    for messages in [*CONVERSATIONS, AGENT_TURNS, AGENT_TURNS[:6]]:
        expected = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True, **kwargs)
        assert ours.render(messages, extra=kwargs) == expected


def test_gemma_style_alternation_and_system_folding_render_as_transformers(
        tmp_path: Path) -> None:
    tokenizer = hf_tokenizer(GEMMA_STYLE)
    ours = ChatTemplate.load(write_config(tmp_path, bos_token="<s>", chat_template=GEMMA_STYLE),
                             {})
    for messages in CONVERSATIONS:
        for add in (True, False):
            expected = tokenizer.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=add)
            assert ours.render(messages, add_generation_prompt=add) == expected
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ours.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
