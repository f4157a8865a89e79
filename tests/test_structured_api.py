"""Structured output, tool calls, logprobs and n through a live daemon with the official clients."""

import json
import threading

import jsonschema
import ollama
import openai
import pytest

from daemon_fixture import MODEL, http, serving

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0},
                         "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 40},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                         "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, smollm2_path):
    with serving(tmp_path_factory.mktemp("structured"), smollm2_path) as d:
        yield d


@pytest.fixture(scope="module")
def oai(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def olm(daemon):
    return ollama.Client(host=daemon.url)


SAMPLINGS = [pytest.param({"temperature": 0}, id="greedy"), pytest.param({"temperature": 1.0, "seed": 7}, id="sampled")]


# ---------------------------------------------------------------------------- structured output

@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_ollama_format_schema_output_validates(olm, sampling, stream):
    kwargs = dict(model=MODEL, messages=ASK, format=PERSON, options={**sampling, "num_predict": 80})
    if stream:
        chunks = list(olm.chat(stream=True, **kwargs))
        text, reason = "".join(c.message.content for c in chunks), chunks[-1].done_reason
    else:
        r = olm.chat(**kwargs)
        text, reason = r.message.content, r.done_reason
    jsonschema.validate(json.loads(text), PERSON)
    assert reason == "stop"


def test_ollama_format_json_is_an_object_on_generate(olm):
    r = olm.generate(model=MODEL, prompt="Give me a JSON object with a cat's name and age.", format="json",
                     options={"temperature": 0, "num_predict": 80})
    assert isinstance(json.loads(r.response), dict) and r.done_reason == "stop"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_openai_json_schema_output_validates(oai, sampling, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    kwargs = dict(model=MODEL, messages=ASK, response_format=fmt, max_tokens=80, **sampling)
    if stream:
        chunks = list(oai.chat.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        r = oai.chat.completions.create(**kwargs)
        text, reason = r.choices[0].message.content, r.choices[0].finish_reason
    jsonschema.validate(json.loads(text), PERSON)
    assert reason == "stop"


def test_openai_json_object(oai):
    cat = [{"role": "user", "content": "Give me a JSON object with a cat's name and age."}]
    r = oai.chat.completions.create(model=MODEL, messages=cat, response_format={"type": "json_object"},
                                    temperature=0, max_tokens=80)
    assert isinstance(json.loads(r.choices[0].message.content), dict) and r.choices[0].finish_reason == "stop"


# ---------------------------------------------------------------------------- tools

def _follow_up(oai, call, tools):
    history = WEATHER_ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                             {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "rain"}'}]
    # tool_choice "none": an answer in words (left free, a 135M model may well call a tool again)
    return oai.chat.completions.create(model=MODEL, messages=history, tools=tools, tool_choice="none", temperature=0,
                                       max_tokens=60)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_openai_forced_tool_call_validates_and_the_result_is_answered(oai, choice):
    r = oai.chat.completions.create(model=MODEL, messages=WEATHER_ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                    temperature=0, max_tokens=80)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    if call.function.name == "get_weather":
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        answer = _follow_up(oai, call, [WEATHER, TIME])
        assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None
        # the call and its result reached the model: its prompt is longer than the question alone
        bare = oai.chat.completions.create(model=MODEL, messages=WEATHER_ASK, tools=[WEATHER, TIME], tool_choice="none",
                                           temperature=0, max_tokens=1)
        assert answer.usage.prompt_tokens > bare.usage.prompt_tokens


def test_openai_tool_call_streamed(oai):
    chunks = list(oai.chat.completions.create(model=MODEL, messages=WEATHER_ASK, tools=[WEATHER],
                                              tool_choice="required", temperature=0, max_tokens=80, stream=True))
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    # As vLLM streams a call: its id and name first, then its arguments as they are generated.
    assert [d.function.name for d in deltas] == ["get_weather"] + [None] * (len(deltas) - 1) and len(deltas) > 2
    assert deltas[0].id.startswith("call_") and all(d.index == 0 for d in deltas)
    jsonschema.validate(json.loads("".join(d.function.arguments for d in deltas)), WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not c.choices[0].delta.content for c in chunks)


def test_tool_choice_none_answers_in_text(oai):
    r = oai.chat.completions.create(model=MODEL, messages=WEATHER_ASK, tools=[WEATHER], tool_choice="none",
                                    temperature=0, max_tokens=20)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_ollama_tool_call_and_history(daemon, olm):
    """The Ollama client cannot send tool_choice (a gpushare extension here); its types read the reply."""
    status, body, _ = http("POST", daemon.url + "/api/chat", {
        "model": MODEL, "messages": WEATHER_ASK, "tools": [WEATHER], "tool_choice": "required", "stream": False,
        "options": {"temperature": 0, "num_predict": 80}})
    assert status == 200, body
    message = ollama.ChatResponse.model_validate(body).message
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(dict(call.function.arguments), WEATHER["function"]["parameters"])
    history = WEATHER_ASK + [message.model_dump(exclude_none=True),
                             {"role": "tool", "tool_name": "get_weather", "content": '{"temperature": 18}'}]
    # without tools this time: an answer in words (offered tools, a 135M model may well call one again)
    r = olm.chat(model=MODEL, messages=history, options={"temperature": 0, "num_predict": 40})
    bare = olm.chat(model=MODEL, messages=WEATHER_ASK, options={"temperature": 0, "num_predict": 1})
    assert r.message.content and r.prompt_eval_count > bare.prompt_eval_count


def test_ollama_tool_call_streamed(daemon):
    from http.client import HTTPConnection
    conn = HTTPConnection("127.0.0.1", int(daemon.host.split(":")[1]), timeout=120)
    conn.request("POST", "/api/chat", json.dumps({
        "model": MODEL, "messages": WEATHER_ASK, "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "options": {"temperature": 0, "num_predict": 80}}))
    chunks = [ollama.ChatResponse.model_validate(json.loads(line)) for line in conn.getresponse().read().splitlines()]
    calls = [call for c in chunks for call in c.message.tool_calls or []]
    assert [call.function.name for call in calls] == ["get_weather"]
    jsonschema.validate(dict(calls[0].function.arguments), WEATHER["function"]["parameters"])
    assert not "".join(c.message.content or "" for c in chunks) and chunks[-1].done


# ---------------------------------------------------------------------------- logprobs

def test_openai_chat_greedy_top_logprob_is_the_chosen_token(oai):
    r = oai.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=8, logprobs=True,
                                    top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 5
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob
        assert bytes(t.bytes).decode() == t.token


def test_openai_chat_logprobs_streamed_match_whole(oai):
    kwargs = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=8, logprobs=True, top_logprobs=2)
    whole = oai.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = [t for c in oai.chat.completions.create(stream=True, **kwargs) if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in whole]


def test_openai_completions_logprobs(oai):
    r = oai.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=6,
                               logprobs=3)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert max(top.values()) == value and top[token] == value and len(top) <= 3


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_ollama_logprobs(olm, stream):
    kwargs = dict(model=MODEL, prompt="Say hello.", logprobs=True, top_logprobs=3,
                  options={"temperature": 0, "num_predict": 6})
    if stream:
        chunks = list(olm.generate(stream=True, **kwargs))
        text, logprobs = "".join(c.response for c in chunks), [lp for c in chunks for lp in c.logprobs or []]
    else:
        r = olm.generate(**kwargs)
        text, logprobs = r.response, r.logprobs
    assert "".join(lp.token for lp in logprobs) == text
    for lp in logprobs:
        assert lp.top_logprobs[0].token == lp.token and lp.top_logprobs[0].logprob == lp.logprob


def test_logprobs_follow_the_grammar_mask(oai):
    """Logprobs are of the logits the sampler used: a token the schema forces has logprob 0."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = oai.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, temperature=0, max_tokens=80,
                                    logprobs=True)
    first = r.choices[0].logprobs.content[0]
    assert first.token == '{"' and first.logprob == 0.0


# ---------------------------------------------------------------------------- n

def test_n_gives_n_choices(oai):
    r = oai.chat.completions.create(model=MODEL, messages=ASK, temperature=1.0, seed=3, max_tokens=12, n=3,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.content and c.finish_reason == "length" for c in r.choices)
    assert len({c.message.content for c in r.choices}) > 1  # each answer draws from its own seeded generator
    assert r.usage.completion_tokens == 3 * 12
    greedy = oai.completions.create(model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=8, n=3)
    alone = oai.completions.create(model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=8)
    assert [c.text for c in greedy.choices] == [alone.choices[0].text] * 3


def test_n_streamed_finishes_every_choice(oai):
    chunks = list(oai.completions.create(model=MODEL, prompt="Once upon a time", temperature=0.8, seed=1,
                                         max_tokens=6, n=3, stream=True))
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length", 2: "length"}


def _first_tokens(daemon, body: dict, answers: int):
    """Start a streamed completion and read until ``answers`` choices have a token; the open stream."""
    from http.client import HTTPConnection
    conn = HTTPConnection("127.0.0.1", int(daemon.host.split(":")[1]), timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "stream": True, **body}))
    resp = conn.getresponse()
    assert resp.status == 200
    seen = set()
    while len(seen) < answers:
        line = resp.readline()
        assert line, "the stream ended early"
        if line.startswith(b"data: {"):
            seen.add(json.loads(line[6:])["choices"][0]["index"])
    return conn


def test_n_shares_the_prompt_kv_blocks(daemon):
    """n=4 holds the prompt's full blocks once: fewer KV blocks than 4 requests of the same size."""
    story = " ".join(["the quiet river ran past the old mill and the children"] * 9)  # ~100 tokens

    def blocks_used():
        return http("GET", daemon.url + "/api/ps")[1]["models"][0]["kv_blocks_used"]

    assert wait_idle(daemon, blocks_used)
    long = {"temperature": 0, "max_tokens": 500, "ignore_eos": True}
    conn = _first_tokens(daemon, {"prompt": "Story: " + story, "n": 4, **long}, 4)
    forked = blocks_used()
    conn.close()
    assert wait_idle(daemon, blocks_used)
    conns = [_first_tokens(daemon, {"prompt": f"Story {i}: " + story, **long}, 1) for i in range(4)]
    separate = blocks_used()
    for c in conns:
        c.close()
    assert wait_idle(daemon, blocks_used)
    prompt_blocks = 100 // 16
    assert forked < separate - 2 * prompt_blocks, (forked, separate)


def wait_idle(daemon, blocks_used):
    from daemon_fixture import wait_for
    return wait_for(lambda: blocks_used() == 0, timeout_s=30)


# ---------------------------------------------------------------------------- model facts

def test_show_lists_tools_and_models_have_max_model_len(olm, oai):
    assert {"completion", "tools"} <= set(olm.show(MODEL).capabilities)
    (entry,) = oai.models.list().data
    assert entry.model_extra["max_model_len"] == 8192


# ---------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"n": 5}, "n"),
    ({"n": 2, "best_of": 3}, "best_of"),
])
def test_openai_bad_input_is_a_400_naming_the_field(oai, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=body)
    assert e.value.body["param"] == param and param in e.value.body["message"]


@pytest.mark.parametrize("body, param", [
    ({"format": {"type": "foo"}}, "format"),
    ({"format": {"type": "object", "not": {"required": ["a"]}}}, "format"),
    ({"format": "yaml"}, "format"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_ollama_bad_input_is_a_400_naming_the_field(daemon, body, param):
    status, reply, _ = http("POST", daemon.url + "/api/chat", {"model": MODEL, "messages": ASK, "stream": False,
                                                                **body})
    assert status == 400 and f'"{param}"' in reply["error"]


def test_concurrent_constrained_and_free_requests(oai):
    """A constrained and an unconstrained request in one batch: each gets what it asked for."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    results = {}

    def run(name, **kw):
        results[name] = oai.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=60, **kw)

    threads = [threading.Thread(target=run, args=("json",), kwargs={"response_format": fmt}),
               threading.Thread(target=run, args=("free",))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    jsonschema.validate(json.loads(results["json"].choices[0].message.content), PERSON)
    alone = oai.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=60)
    assert results["free"].choices[0].message.content == alone.choices[0].message.content
