"""Tool prompts through a template that handles tools and through the fallback; replies parsed into
calls; the streamed-reply filter; KV block sharing for n answers. The real SmolLM2 tokenizer and
template, and a Hermes/Qwen-style template as such models ship it."""

import json

import pytest

from gpushare.api.tools import (ReplyFilter, ToolSpec, parse_calls, render_messages, template_handles_tools)
from gpushare.catalog.gguf_reader import read_gguf_file
from gpushare.catalog.model_head import LoadedModel
from gpushare.catalog.tokenizer import tokenizer_from_gguf

HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    "</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{%- for tc in message.tool_calls %}<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
    {"role": "tool", "content": '{"sky": "snow"}', "name": "get_weather"},
]


@pytest.fixture(scope="module")
def gguf_meta(smollm2_path):
    return read_gguf_file(smollm2_path)[0]


def model_with(meta, template):
    """A LoadedModel as far as prompts go: SmolLM2's tokenizer and the given template (no weights)."""
    return LoadedModel(name_or_path="smollm2", config=None, model=None, tokenizer=tokenizer_from_gguf(meta),
                       template_source=template, stop_token_ids=set(), dtype=None, device="cpu")


def test_a_template_with_tools_renders_them_and_the_history(gguf_meta):
    model = model_with(gguf_meta, HERMES_TEMPLATE)
    assert template_handles_tools(model)
    messages, extra = render_messages(model, HISTORY, ToolSpec([WEATHER]))
    text = model.render_chat(messages, **extra)
    assert json.dumps(WEATHER, ensure_ascii=False) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert '<tool_response>\n{"sky": "snow"}\n</tool_response>' in text


def test_smollm2_template_gets_the_fallback(gguf_meta):
    model = model_with(gguf_meta, gguf_meta["tokenizer.chat_template"])
    assert not template_handles_tools(model)
    messages, extra = render_messages(model, HISTORY, ToolSpec([WEATHER]))
    assert extra == {}
    text = model.render_chat(messages)
    assert text.startswith("<|im_start|>system\nYou can call the following tools")
    assert json.dumps(WEATHER["function"]) in text
    assert '<|im_start|>assistant\n{"name": "get_weather", "arguments": {"city": "Oslo"}}<|im_end|>' in text
    assert '<|im_start|>tool\n{"sky": "snow"}<|im_end|>' in text


def test_tool_choice_none_offers_no_tools(gguf_meta):
    model = model_with(gguf_meta, gguf_meta["tokenizer.chat_template"])
    messages, _ = render_messages(model, HISTORY[:1], ToolSpec([WEATHER], choice="none"))
    assert messages == HISTORY[:1]


@pytest.mark.parametrize("text, calls", [
    ('{"name": "get_weather", "arguments": {"city": "Oslo"}}',
     [{"name": "get_weather", "arguments": {"city": "Oslo"}}]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
     [{"name": "get_weather", "arguments": {"city": "Rome"}}]),
    ('[{"name": "get_weather", "arguments": {}}, {"name": "get_weather", "parameters": {"city": "Lima"}}]',
     [{"name": "get_weather", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Lima"}}]),
    ('{"name": "launch_rockets", "arguments": {}}', None),
    ('{"city": "Oslo"}', None),
    ("It is sunny in Oslo.", None),
])
def test_replies_parse_into_calls(text, calls):
    assert parse_calls(text, ToolSpec([WEATHER])) == calls


def test_reply_filter_streams_text_and_holds_calls():
    text = ReplyFilter(ToolSpec([WEATHER]))
    assert [text.feed("It"), text.feed(" is"), text.finish()] == ["It", " is", ("", None)]
    call = ReplyFilter(ToolSpec([WEATHER]))
    pieces = [call.feed(p) for p in ['{"name": "get_', 'weather", "arguments": {}}']]
    assert pieces == ["", ""] and call.finish() == ("", [{"name": "get_weather", "arguments": {}}])
    tagged = ReplyFilter(ToolSpec([WEATHER]))
    assert tagged.feed("<tool") == "" and tagged.feed("kit is") == "<toolkit is"
    json_text = ReplyFilter(ToolSpec([WEATHER]))
    assert json_text.feed('{"a": 1}') == "" and json_text.finish() == ('{"a": 1}', None)
