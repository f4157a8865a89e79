"""The OpenAI dialect (/v1/*) of a live daemon, driven by the official `openai` client.

One daemon for the module, with a small queue (max_num_seqs 2 + max_queued 1) so that
the 503 path is reachable. Greedy answers must equal the offline LLM API's.
"""

import json
import socket

import openai
import pytest
from daemon_fixture import MODEL, http, serving, wait_for

from gpushare import SamplingParams


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, smollm2_path, request):
    with serving(tmp_path_factory.mktemp("openai"), smollm2_path,
                 {"engine": {"max_num_seqs": 2}, "server": {"max_queued": 1}},
                 while_loading=lambda: request.getfixturevalue("served_llm")) as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=120)


MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_completion_equals_offline_llm(client, served_llm):
    expected = served_llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=10))[0]
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=10)
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    assert r.usage.completion_tokens == len(expected.token_ids)
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_completion_stream_with_usage(client, served_llm):
    expected = served_llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=10))[0]
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                                 max_completion_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == expected.finish_reason and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_equals_offline_llm_streamed_or_not(client, served_llm):
    prompt = "The capital of France is"
    expected = served_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8))[0]
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8)
    assert r.choices[0].text == expected.text and r.choices[0].finish_reason == expected.finish_reason
    assert r.object == "text_completion" and r.usage.completion_tokens == len(expected.token_ids)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected.text


def test_completion_takes_token_ids_and_vllm_extras(client, served_llm):
    ids = served_llm.tokenizer.encode("Once upon a time", add_special_tokens=True)
    expected = served_llm.generate([ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    r = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=6,
                                  extra_body={"ignore_eos": True, "top_k": 5, "min_p": 0.05})
    assert r.choices[0].text == expected.text and r.usage.completion_tokens == 6


def test_stop_and_seed(client):
    kwargs = {"model": MODEL, "prompt": "Count: one, two, three,", "temperature": 0, "max_tokens": 10}
    full = client.completions.create(**kwargs).choices[0].text
    stop = full.strip().split()[1]
    cut = client.completions.create(**kwargs, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and stop not in cut.text and full.startswith(cut.text)
    sampled = [client.completions.create(model=MODEL, prompt="Tell me a story", temperature=1.0, seed=7,
                                         max_tokens=8).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).owned_by == "gpushare"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_embeddings_float_and_base64(client):
    floats = client.embeddings.create(model=MODEL, input=["hello world", "goodbye"], encoding_format="float")
    b64 = client.embeddings.create(model=MODEL, input=["hello world", "goodbye"])  # the client asks base64
    assert [d.index for d in floats.data] == [0, 1] and len(floats.data[0].embedding) == 576
    for a, b in zip(floats.data, b64.data):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-6)
    assert floats.usage.prompt_tokens > 0


def test_disconnect_mid_stream_frees_kv_blocks(daemon):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 300, "stream": True, "ignore_eos": True}
    with socket.create_connection(("127.0.0.1", int(daemon.host.split(":")[1]))) as s:
        s.sendall(_post("/v1/chat/completions", body))
        received = b""
        while b"data: " not in received:
            received += s.recv(4096)
        assert daemon.loaded()[MODEL]["kv_blocks_used"] > 0
    assert wait_for(lambda: daemon.loaded()[MODEL]["kv_blocks_used"] == 0, timeout_s=10)


def _post(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def test_full_queue_is_503_with_retry_after(daemon):
    # max_num_seqs 2 + max_queued 1: three requests in flight fill the model's queue.
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 300, "stream": True, "ignore_eos": True}
    port = int(daemon.host.split(":")[1])
    holders = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    try:
        for s in holders:
            s.sendall(_post("/v1/completions", body))
        assert wait_for(lambda: daemon.loaded()[MODEL]["requests"] == 3, timeout_s=20)
        status, err, headers = http("POST", daemon.url + "/v1/completions", {**body, "stream": False})
        assert status == 503 and int(headers["Retry-After"]) >= 1
        assert "requests in flight" in err["error"]["message"] and err["error"]["type"] == "server_error"
    finally:
        for s in holders:
            s.close()
    assert wait_for(lambda: daemon.loaded()[MODEL]["requests"] == 0, timeout_s=10)


# ---------------------------------------------------------------------------- bad input

def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=MESSAGES)
    assert info.value.body["message"] == 'model "nope" not found' and info.value.body["code"] == "model_not_found"


def test_n_above_max_num_seqs_is_rejected(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, n=5)
    assert info.value.body["param"] == "n" and "at most engine.max_num_seqs (2)" in info.value.body["message"]


def test_prompt_longer_than_the_context_is_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hello " * 9000, max_tokens=4)
    assert "the prompt is 9001 tokens, and the usable context is" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=9000)
    assert "max_tokens" in info.value.body["message"]


def test_wrong_types_and_malformed_json_are_400_in_openai_shape(daemon):
    url = daemon.url + "/v1/chat/completions"
    cases = [
        ({"model": MODEL, "messages": MESSAGES, "temperature": "hot"}, "temperature", '"temperature" must be a number'),
        ({"model": MODEL, "messages": "hi"}, "messages", '"messages" must be an array'),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "must be one of"),
        ({"model": MODEL, "messages": MESSAGES, "stream_options": {"include_usage": 1}, "stream": True},
         "stream_options.include_usage", "must be a boolean"),
        ({"messages": MESSAGES}, "model", '"model" is required'),
    ]
    for body, param, message in cases:
        status, err, _ = http("POST", url, body)
        assert status == 400 and err["error"]["param"] == param and message in err["error"]["message"], err
        assert err["error"]["type"] == "invalid_request_error"
    status, err, _ = http("POST", url, b"{not json")
    assert status == 400 and err["error"]["message"].startswith("invalid JSON")
    status, err, _ = http("POST", daemon.url + "/v1/completions", {"model": MODEL, "prompt": ["a", "b"]})
    assert status == 400 and "one prompt per request" in err["error"]["message"]


def test_unknown_route_is_404_json(daemon):
    status, err, _ = http("GET", daemon.url + "/v1/nothing")
    assert status == 404 and "error" in err and isinstance(err["error"], dict)
