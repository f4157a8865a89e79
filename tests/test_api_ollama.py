"""The Ollama dialect (/api/*) of a live daemon, driven by the official `ollama` client.

One daemon for the module (SmolLM2-135M on CPU, preloaded); answers are kept short.
Greedy answers must equal the offline LLM API's for the same input.
"""

import json
import os
import time
from http.client import HTTPConnection

import ollama
import psutil
import pytest
from daemon_fixture import MODEL, http, serving, wait_for

from gpushare import SamplingParams

GREEDY = {"temperature": 0, "num_predict": 10}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, smollm2_path, request):
    # The offline oracle loads while the daemon loads its copy.
    with serving(tmp_path_factory.mktemp("ollama"), smollm2_path,
                 while_loading=lambda: request.getfixturevalue("served_llm")) as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon):
    return ollama.Client(host=daemon.url, timeout=120)


def test_root_and_version(daemon):
    status, text, _ = http("GET", daemon.url + "/")
    assert (status, text) == (200, "gpushare is running")
    assert http("HEAD", daemon.url + "/")[0] == 200
    status, body, _ = http("GET", daemon.url + "/api/version")
    assert status == 200 and body["version"]


def test_raw_generate_equals_offline_llm(client, served_llm):
    prompt = "The capital of France is"
    expected = served_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10))[0]
    r = client.generate(MODEL, prompt, raw=True, options=GREEDY, stream=False)
    assert r.response == expected.text
    assert r.done and r.done_reason == expected.finish_reason
    assert r.eval_count == len(expected.token_ids)
    assert r.prompt_eval_count == len(expected.prompt_token_ids)
    assert r.total_duration >= r.eval_duration > 0 and r.prompt_eval_duration > 0 and r.load_duration == 0


def test_chat_equals_offline_llm_streamed_or_not(client, served_llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = served_llm.chat(messages, SamplingParams(temperature=0, max_tokens=10))[0]
    whole = client.chat(MODEL, messages=messages, options=GREEDY, stream=False)
    assert whole.message.role == "assistant" and whole.message.content == expected.text
    chunks = list(client.chat(MODEL, messages=messages, options=GREEDY, stream=True))
    assert "".join(c.message.content for c in chunks) == expected.text
    assert [c.done for c in chunks] == [False] * (len(chunks) - 1) + [True]
    final = chunks[-1]
    assert final.done_reason == expected.finish_reason and final.eval_count == len(expected.token_ids)


def test_generate_applies_system_and_chat_template(client, served_llm):
    expected = served_llm.chat([{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello"}],
                        SamplingParams(temperature=0, max_tokens=8))[0]
    chunks = list(client.generate(MODEL, "Hello", system="Answer in French.", stream=True,
                                  options={"temperature": 0, "num_predict": 8}))
    assert "".join(c.response for c in chunks) == expected.text
    assert chunks[-1].done and chunks[-1].eval_count == len(expected.token_ids)


def test_stop_option_cuts_the_answer(client):
    full = client.generate(MODEL, "Count: one, two, three,", raw=True, options=GREEDY).response
    stop = full.strip().split()[1]  # a word from the middle of the greedy answer
    cut = client.generate(MODEL, "Count: one, two, three,", raw=True, options={**GREEDY, "stop": [stop]})
    assert cut.done_reason == "stop" and stop not in cut.response and full.startswith(cut.response)


def test_seeded_sampling_is_reproducible(client):
    opts = {"temperature": 1.0, "seed": 1234, "num_predict": 8}
    a = client.generate(MODEL, "Tell me a story", options=opts).response
    b = client.generate(MODEL, "Tell me a story", options=opts).response
    assert a == b


def test_tags_lists_the_model(client, smollm2_path):
    models = {m.model: m for m in client.list().models}
    m = models[MODEL]
    assert m.size == os.path.getsize(smollm2_path) and len(m.digest) == 64
    assert m.details.format == "gguf" and m.details.family == "llama"


def test_show(client, daemon, served_llm):
    r = client.show(MODEL)
    assert r.details.family == "llama" and r.details.parameter_size == "135M"
    assert r.details.quantization_level == "Q4_1"
    assert r.modelinfo["llama.context_length"] == 8192 and r.modelinfo["general.architecture"] == "llama"
    assert "<|im_start|>" in r.template
    assert "completion" in r.capabilities
    status, body, _ = http("POST", daemon.url + "/api/show", {"model": MODEL}, headers={"Content-Type": "application/json"})
    assert status == 200 and body["weights"] == served_llm.model.weights  # "auto": int8 where it is faster here


def test_ps_reports_the_loaded_model_and_its_kv_blocks(client, daemon, served_llm):
    (m,) = client.ps().models
    raw = daemon.loaded()[MODEL]
    # context_length: what one request can get, the trained 8192 capped by the model's KV pool
    assert m.context_length == min(8192, raw["kv_blocks_total"] * raw["kv_block_size"])
    assert m.model == MODEL and raw["trained_context_length"] == 8192 and m.size > 0 and m.size_vram == 0
    assert raw["kv_blocks_total"] > 0 and raw["kv_blocks_used"] == 0
    assert raw["running"] == 0 and raw["queued"] == 0
    # size is what it holds now: its weights as stored (int8: a quarter of float32's) plus the KV pool
    # slabs it holds (an idle model may hold some: its cached prefixes, until it has been idle a while)
    assert raw["weights"] == served_llm.model.weights and raw["weight_bytes"] == served_llm.model.weight_bytes
    assert m.size == raw["weight_bytes"] + raw["kv_committed_bytes"]
    assert raw["kv_dtype"] == "bfloat16"  # engine.kv_dtype auto, quantized weights, on the CPU
    # the whole pool is this model's to grow into: every block of it, bfloat16 (2 bytes)
    block_bytes = 2 * 30 * 3 * 64 * 2 * raw["kv_block_size"]  # k and v, 30 layers, 3 KV heads of 64
    memory = http("GET", daemon.url + "/api/ps")[1]["memory"]
    assert raw["kv_blocks_total"] == memory["kv_pool_bytes"] // block_bytes
    assert memory["weight_bytes"] == served_llm.model.weight_bytes
    assert memory["rss_bytes"] == (memory["weight_bytes"] + memory["kv_committed_bytes"]
                                   + memory["runtime_overhead_bytes"])
    # a CPU engine's device memory is the host's RAM, as its worker saw it: used and free, both real
    (device,) = memory["devices"]
    ram = psutil.virtual_memory()
    assert device["device"] == "cpu" and device["memory"] == "host"
    assert 0 < device["free_bytes"] < ram.total and 0 < device["used_bytes"] < ram.total
    assert device["used_bytes"] + device["free_bytes"] == ram.total
    # the worker holds the loaded weights in that RAM: the used figure covers them
    assert device["used_bytes"] > memory["weight_bytes"]


def test_embed(client, daemon):
    r = client.embed(MODEL, input=["hello world", "a cat sat on the mat"])
    assert len(r.embeddings) == 2 and len(r.embeddings[0]) == 576
    assert abs(sum(x * x for x in r.embeddings[0]) - 1.0) < 1e-3  # L2-normalised
    assert r.embeddings[0] != r.embeddings[1] and r.prompt_eval_count > 0
    again = client.embed(MODEL, input="hello world").embeddings[0]
    assert again == pytest.approx(r.embeddings[0], abs=1e-5)
    legacy = client.embeddings(MODEL, prompt="hello world").embedding
    assert legacy == pytest.approx(r.embeddings[0], abs=1e-5)


def test_disconnect_cancels_and_frees_kv_blocks(daemon):
    conn = HTTPConnection("127.0.0.1", int(daemon.host.split(":")[1]), timeout=60)
    # Greedy, this story runs the whole 400 tokens (no early end of sequence), long after the checks below.
    body = {"model": MODEL, "prompt": "Write a very long story about a dragon.",
            "options": {"num_predict": 400, "temperature": 0}}
    conn.request("POST", "/api/generate", json.dumps(body))
    resp = conn.getresponse()
    first = json.loads(resp.readline())
    assert first["done"] is False
    assert daemon.loaded()[MODEL]["kv_blocks_used"] > 0
    conn.sock.shutdown(2)
    conn.close()
    assert wait_for(lambda: daemon.loaded()[MODEL]["kv_blocks_used"] == 0, timeout_s=10)
    assert daemon.loaded()[MODEL]["running"] == 0


def test_unload_then_load_with_keep_alive(client, daemon):
    r = client.generate(MODEL, keep_alive=0)
    assert r.done and r.done_reason == "unload"
    assert MODEL not in daemon.loaded()
    r = client.chat(MODEL, messages=[], keep_alive=-1)
    assert r.done and r.done_reason == "load" and r.message.role == "assistant"
    (m,) = client.ps().models
    assert m.expires_at.year > time.gmtime().tm_year + 100  # forever
    client.generate(MODEL, keep_alive="10m")
    expires = client.ps().models[0].expires_at.timestamp()
    assert abs(expires - (time.time() + 600)) < 30


# ---------------------------------------------------------------------------- bad input

def expect_error(call, status: int, *fragments: str):
    with pytest.raises(ollama.ResponseError) as info:
        call()
    assert info.value.status_code == status, info.value
    for fragment in fragments:
        assert fragment in info.value.error
    return info.value


def test_unknown_model_is_404(client):
    expect_error(lambda: client.generate("nope:1b", "hi"), 404, 'model "nope:1b" not found')
    expect_error(lambda: client.chat("nope:1b", messages=[{"role": "user", "content": "hi"}]), 404,
                 'model "nope:1b" not found')
    expect_error(lambda: client.show("nope:1b"), 404, 'model "nope:1b" not found')
    expect_error(lambda: client.embed("nope:1b", input="hi"), 404, 'model "nope:1b" not found')


def test_prompt_longer_than_the_context_is_400(client):
    expect_error(lambda: client.generate(MODEL, "one two three four five six seven eight nine ten " * 3,
                                         options={"num_ctx": 16}), 400, "the usable context is 16 tokens")


def test_wrong_types_name_the_field(daemon):
    cases = [
        ({"model": MODEL, "prompt": "hi", "options": {"temperature": "hot"}}, '"options.temperature" must be a number'),
        ({"model": MODEL, "prompt": 5}, '"prompt" must be a string'),
        ({"model": MODEL, "prompt": "hi", "stream": "yes"}, '"stream" must be a boolean'),
        ({"model": MODEL, "prompt": "hi", "keep_alive": "soon"}, '"keep_alive" must be a duration'),
        ({"prompt": "hi"}, '"model" is required'),
        ({"model": MODEL, "prompt": "hi", "options": {"top_p": 7}}, '"options.top_p" must be in (0, 1]'),
    ]
    for body, message in cases:
        status, err, _ = http("POST", daemon.url + "/api/generate", body)
        assert status == 400 and message in err["error"], (body, err)
    status, err, _ = http("POST", daemon.url + "/api/chat", {"model": MODEL, "messages": [{"role": "king"}]})
    assert status == 400 and '"messages[0].role" must be one of' in err["error"]


def test_malformed_json_is_400(daemon):
    status, err, _ = http("POST", daemon.url + "/api/chat", b'{"model": ')
    assert status == 400 and err["error"].startswith("invalid JSON in request body")


def test_unsupported_fields_are_rejected_clearly(client):
    expect_error(lambda: client.generate(MODEL, "hi", suffix="end"), 400, '"suffix"', "not supported")
    expect_error(lambda: client.generate(MODEL, "hi", think=True), 400, f'"{MODEL}"', "does not support thinking")
