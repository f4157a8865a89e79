"""Anthropic's Messages API (/v1/messages) of a live daemon, driven by the official `anthropic` client.

The daemon has tenants, so every request carries a key: the anthropic client sends it as
``x-api-key``, the openai client (the chat completions a Messages turn is compared with) as
``Authorization: Bearer``. Greedy answers must equal the offline LLM API's.
"""

import json
import socket

import anthropic
import jsonschema
import openai
import pytest
from daemon_fixture import MODEL, http, serving, wait_for

from gpushare import SamplingParams

KEY = "anthropic-test-key"
GREEDY = {"temperature": 0}  # this client no longer has sampling arguments; the API still takes them
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                            "additionalProperties": False}}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, smollm2_path, request):
    with serving(tmp_path_factory.mktemp("anthropic"), smollm2_path,
                 {"tenants": [{"name": "coder", "api_keys": [KEY]}]},
                 while_loading=lambda: request.getfixturevalue("served_llm")) as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon):
    return anthropic.Anthropic(base_url=daemon.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat_client(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_message_equals_offline_chat_with_system(client, served_llm):
    system = "You are a terse geography teacher."
    expected = served_llm.chat([{"role": "system", "content": system}, *MESSAGES],
                               SamplingParams(temperature=0, max_tokens=12))[0]
    r = client.messages.create(model=MODEL, system=[{"type": "text", "text": system}], messages=MESSAGES,
                               max_tokens=12, extra_body=GREEDY, metadata={"user_id": "u1"})
    assert r.type == "message" and r.role == "assistant" and r.model == MODEL and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == expected.text
    assert r.stop_reason == ("max_tokens" if expected.finish_reason == "length" else "end_turn")
    assert r.stop_sequence is None
    assert r.usage.input_tokens == len(expected.prompt_token_ids)
    assert r.usage.output_tokens == len(expected.token_ids)


def test_stream_is_anthropics_event_sequence(client, served_llm):
    expected = served_llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=12))[0]
    with client.messages.stream(model=MODEL, messages=MESSAGES, max_tokens=12, extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[-2] == "message_delta" and "content_block_start" in kinds and "content_block_stop" in kinds
    assert events[0].message.usage.input_tokens == len(expected.prompt_token_ids)
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert len(deltas) > 1 and "".join(deltas) == expected.text
    assert final.content[0].text == expected.text and final.usage.output_tokens == len(expected.token_ids)
    assert final.stop_reason == ("max_tokens" if expected.finish_reason == "length" else "end_turn")


def test_stop_sequences_behave_as_in_chat(client, chat_client):
    full = client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=12, extra_body=GREEDY).content[0].text
    stop = full.split()[2]
    chat = chat_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                               stop=[stop]).choices[0].message.content
    r = client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=12, extra_body=GREEDY,
                               stop_sequences=["no such text", stop])
    assert r.content[0].text == chat and stop not in chat and full.startswith(chat)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop


def test_forced_tool_use_and_its_result_back(client, chat_client):
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.messages.create(model=MODEL, messages=weather, max_tokens=60, extra_body=GREEDY, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "get_weather"})
    (call,) = r.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    assert r.stop_reason == "tool_use"
    history = [*weather, {"role": "assistant", "content": [call.model_dump()]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}]}]
    answer = client.messages.create(model=MODEL, messages=history, max_tokens=15, extra_body=GREEDY, tools=[WEATHER])
    # The same conversation in OpenAI's shape gets the same greedy answer: one rendering for both.
    tools = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    same = chat_client.chat.completions.create(model=MODEL, max_tokens=15, temperature=0, tools=tools, messages=[
        *weather, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}])
    assert answer.content[0].type == "text" and answer.content[0].text == same.choices[0].message.content
    assert answer.usage.input_tokens == same.usage.prompt_tokens


def test_forced_tool_use_streams_its_input(client):
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    whole = client.messages.create(model=MODEL, messages=weather, max_tokens=60, extra_body=GREEDY, tools=[WEATHER],
                                   tool_choice={"type": "any"})
    with client.messages.stream(model=MODEL, messages=weather, max_tokens=60, extra_body=GREEDY, tools=[WEATHER],
                                tool_choice={"type": "any"}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == ["tool_use"] and starts[0].content_block.name == "get_weather"
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == whole.content[0].input  # as generated, not at the end
    assert final.stop_reason == "tool_use" and final.content[0].input == whole.content[0].input


def test_count_tokens_equals_the_prompts_tokens(client, served_llm):
    system = "Answer in one word."
    expected = served_llm.chat([{"role": "system", "content": system}, *MESSAGES],
                               SamplingParams(temperature=0, max_tokens=1))[0]
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=MESSAGES)
    assert counted.input_tokens == len(expected.prompt_token_ids)
    with_tools = client.messages.count_tokens(model=MODEL, system=system, messages=MESSAGES, tools=[WEATHER])
    r = client.messages.create(model=MODEL, system=system, messages=MESSAGES, tools=[WEATHER], max_tokens=1)
    assert with_tools.input_tokens == r.usage.input_tokens > counted.input_tokens


def _post(daemon, body: dict, headers: dict | None = None):
    return http("POST", daemon.url + "/v1/messages", body,
                headers={"Content-Type": "application/json", "x-api-key": KEY, "anthropic-version": "2023-06-01",
                         **(headers or {})})


@pytest.mark.parametrize("body, param", [
    ({"messages": MESSAGES}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "url": "x"}]}], "max_tokens": 5},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope",
                                                 "content": "x"}]}], "max_tokens": 5},
     "messages[0].content[0].tool_use_id"),
    ({"messages": MESSAGES, "max_tokens": 10, "thinking": {"type": "enabled", "budget_tokens": 10}},
     "thinking.budget_tokens"),
])
def test_bad_input_is_anthropics_400_naming_the_field(daemon, body, param):
    status, answer, _ = _post(daemon, {"model": MODEL, **body})
    assert status == 400 and answer["type"] == "error"
    assert answer["error"]["type"] == "invalid_request_error" and f'"{param}"' in answer["error"]["message"]


def test_errors_through_the_client_and_keys(daemon, client):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", messages=MESSAGES, max_tokens=5)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=daemon.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, messages=MESSAGES, max_tokens=5)
    status, answer, _ = _post(daemon, {"model": MODEL, "messages": MESSAGES, "max_tokens": 2},
                              {"x-api-key": "", "Authorization": f"Bearer {KEY}"})
    assert status == 200 and answer["content"][0]["type"] == "text"


def test_thinking_on_a_model_that_does_not_think_is_a_400(client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=20,
                               thinking={"type": "enabled", "budget_tokens": 10})
    assert "does not support thinking" in e.value.body["error"]["message"]


def test_disconnect_mid_stream_frees_kv_blocks(daemon):
    story = [{"role": "user", "content": "Tell me a long story."}]
    # vLLM's ignore_eos (taken here too): minutes of tokens on a CPU, so it is still running when left
    body = json.dumps({"model": MODEL, "messages": story, "max_tokens": 2000, "ignore_eos": True,
                       "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", int(daemon.host.split(":")[1]))) as s:
        s.sendall(f"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"x-api-key: {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        received = b""
        while b"content_block_delta" not in received:
            received += s.recv(4096)
        assert http("GET", daemon.url + "/api/ps", headers={"x-api-key": KEY})[1]["models"][0]["kv_blocks_used"] > 0
    assert wait_for(lambda: http("GET", daemon.url + "/api/ps",
                                 headers={"x-api-key": KEY})[1]["models"][0]["kv_blocks_used"] == 0, timeout_s=10)
