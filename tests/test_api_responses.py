"""OpenAI's Responses API (/v1/responses) of a live daemon, and tool calls streamed in chat completions,
driven by the official `openai` client. Greedy answers must equal the offline LLM API's."""

import json

import jsonschema
import openai
import pytest
from daemon_fixture import MODEL, serving

from gpushare import SamplingParams

QUESTION = "What is the capital of France?"
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": PARAMETERS}
CHAT_TOOL = {"type": "function", "function": {k: TOOL[k] for k in ("name", "description", "parameters")}}
WEATHER = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, smollm2_path, request):
    with serving(tmp_path_factory.mktemp("responses"), smollm2_path,
                 while_loading=lambda: request.getfixturevalue("served_llm")) as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_response_equals_offline_chat(client, served_llm):
    system = "You are a terse geography teacher."
    expected = served_llm.chat([{"role": "system", "content": system}, {"role": "user", "content": QUESTION}],
                               SamplingParams(temperature=0, max_tokens=12))[0]
    r = client.responses.create(model=MODEL, instructions=system, input=QUESTION, max_output_tokens=12, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and [i.type for i in r.output] == ["message"]
    assert r.output_text == expected.text
    assert r.status == ("incomplete" if expected.finish_reason == "length" else "completed")
    assert r.usage.input_tokens == len(expected.prompt_token_ids) and r.usage.output_tokens == len(expected.token_ids)


def test_stream_is_the_responses_event_sequence(client, served_llm):
    expected = served_llm.chat([{"role": "user", "content": QUESTION}], SamplingParams(temperature=0, max_tokens=12))[0]
    events = list(client.responses.create(model=MODEL, input=[{"role": "user", "content": QUESTION}],
                                          max_output_tokens=12, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete") and "response.output_text.done" in kinds
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == expected.text
    assert events[-1].response.output_text == expected.text
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))


def test_forced_function_call_and_its_output_back(client):
    r = client.responses.create(model=MODEL, input=WEATHER, tools=[TOOL], tool_choice="required",
                                max_output_tokens=60, temperature=0)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), PARAMETERS)
    history = [{"role": "user", "content": WEATHER},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    answer = client.responses.create(model=MODEL, input=history, tools=[TOOL], max_output_tokens=15, temperature=0)
    same = client.chat.completions.create(model=MODEL, max_tokens=15, temperature=0, tools=[CHAT_TOOL], messages=[
        {"role": "user", "content": WEATHER},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}])
    assert answer.output_text == same.choices[0].message.content
    assert answer.usage.input_tokens == same.usage.prompt_tokens


def test_function_call_arguments_stream_as_generated(client):
    whole = client.responses.create(model=MODEL, input=WEATHER, tools=[TOOL], tool_choice="required",
                                    max_output_tokens=60, temperature=0).output[0]
    events = list(client.responses.create(model=MODEL, input=WEATHER, tools=[TOOL], tool_choice="required",
                                          max_output_tokens=60, temperature=0, stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["function_call"] and added[0].name == "get_weather"
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == json.loads(whole.arguments)
    assert events[-1].response.output[0].arguments == "".join(pieces)


def test_chat_stream_sends_a_tool_calls_name_then_its_arguments(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": WEATHER}], tools=[CHAT_TOOL],
                  tool_choice="required", max_tokens=60, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    calls = [d.tool_calls[0] for d in (c.choices[0].delta for c in chunks if c.choices) if d.tool_calls]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    assert calls[0].function.arguments == "" and len(calls) > 2
    assert all(c.index == 0 and c.id is None and c.function.name is None for c in calls[1:])
    assert json.loads("".join(c.function.arguments for c in calls)) == json.loads(whole.function.arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"],
              "additionalProperties": False}
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "capital", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)


@pytest.mark.parametrize("extra, param", [({"store": True}, "store"),
                                          ({"previous_response_id": "resp_1"}, "previous_response_id")])
def test_stored_responses_are_refused(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=5, **extra)
    assert e.value.body["param"] == param and f'"{param}"' in e.value.body["message"]


def test_function_call_output_for_an_unknown_call_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, max_output_tokens=5, input=[
            {"role": "user", "content": WEATHER},
            {"type": "function_call_output", "call_id": "call_nope", "output": "x"}])
    assert e.value.body["param"] == "input[1].call_id"
