"""Hostile requests against a live daemon (real HTTP, real SmolLM2): each gets a clear 4xx, or is
served, while a concurrent victim's greedy stream stays exact and the daemon stays up.

One daemon for the module, with tenants (alice, an ordinary tenant; ops, an admin), small
`limits:` so that over-limit bodies stay small, and one extra browser origin.
"""

import json
import socket
from http.client import HTTPConnection

import ollama
import openai
import pytest
from daemon_fixture import MODEL, http, serving, wait_for

ALICE, OPS = "alice-key", "ops-key"
APP_ORIGIN = "https://app.example.com"
LIMITS = {"max_prompt_chars": 4000, "max_messages": 8, "max_stop_strings": 4, "max_stop_chars": 32,
          "max_embed_inputs": 4, "max_embed_tokens": 64, "max_json_depth": 16}
SOLO = "solo-key"  # one request at a time, none queued
OVERRIDES = {"tenants": [{"name": "alice", "api_keys": [ALICE]}, {"name": "ops", "api_keys": [OPS], "admin": True},
                         {"name": "solo", "api_keys": [SOLO], "max_concurrent": 1, "max_queued": 0}],
             "limits": LIMITS, "server": {"origins": [APP_ORIGIN], "write_timeout": "2s"}}
GREEDY = {"temperature": 0, "num_predict": 12}
STORY = "Tell me a long story about a lighthouse."


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, smollm2_path):
    with serving(tmp_path_factory.mktemp("hardening"), smollm2_path, OVERRIDES) as d:
        yield d


def call(daemon, method, path, body=None, key=ALICE, headers=None, raw: bytes | None = None):
    """(status, parsed JSON or text, headers); JSON bodies are sent as application/json."""
    sent = {"Authorization": f"Bearer {key}", "Content-Type": "application/json", **(headers or {})}
    return http(method, daemon.url + path, raw if raw is not None else body, headers=sent)


def ollama_client(daemon, key=ALICE):
    return ollama.Client(host=daemon.url, timeout=120, headers={"Authorization": f"Bearer {key}"})


def openai_client(daemon, key=ALICE):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key=key, max_retries=0, timeout=120)


def assert_400(reply, *fragments, param=None):
    status, body, _ = reply
    assert status == 400, body
    message = body["error"]["message"] if isinstance(body["error"], dict) else body["error"]
    assert all(f in message for f in fragments), message
    if param is not None:
        assert body["error"]["param"] == param, body


# ---------------------------------------------------------------------------- sampling

def test_near_zero_temperature_is_greedy(daemon):
    client = ollama_client(daemon)
    greedy = client.generate(MODEL, "The capital of France is", raw=True, options=GREEDY).response
    tiny = client.generate(MODEL, "The capital of France is", raw=True,
                           options={**GREEDY, "temperature": 1e-40}).response
    assert tiny == greedy
    r = openai_client(daemon).completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12,
                                                 temperature=1e-40)
    assert r.choices[0].text == greedy


@pytest.mark.parametrize("options, fragments", [
    ({"repeat_penalty": 1e-40}, ['"options.repeat_penalty" must be in [0.01, 100]']),
    ({"temperature": 1e30}, ['"options.temperature" must be in [0, 100]']),
    ({"seed": 2 ** 64}, ['"options.seed" must be an integer in [-2**63, 2**64 - 1]']),
])
def test_out_of_range_sampling_is_a_400_naming_the_field(daemon, options, fragments):
    assert_400(call(daemon, "POST", "/api/generate", {"model": MODEL, "prompt": "Hi", "options": options}),
               *fragments)


def test_openai_names_its_own_fields(daemon):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "repetition_penalty": 1e-40}
    assert_400(call(daemon, "POST", "/v1/chat/completions", body), "must be in [0.01, 100]",
               param="repetition_penalty")
    with pytest.raises(openai.BadRequestError, match="seed"):
        openai_client(daemon).chat.completions.create(model=MODEL, messages=body["messages"], seed=-(2 ** 70))


# ---------------------------------------------------------------------------- keep_alive

@pytest.mark.parametrize("keep_alive", ["nan", "inf", "-inf", 1e12, "1000000h"])
def test_keep_alive_must_be_finite_and_bounded(daemon, keep_alive):
    assert_400(call(daemon, "POST", "/api/generate", {"model": MODEL, "keep_alive": keep_alive}, key=OPS),
               '"keep_alive" must be', "finite")
    status, body, _ = call(daemon, "GET", "/api/ps", key=OPS)
    assert status == 200 and [m["name"] for m in body["models"]] == [MODEL]


def test_only_an_admin_may_shorten_keep_alive_below_the_floor(daemon):
    for keep_alive in ("1ms", "59s", 0.001):
        status, body, _ = call(daemon, "POST", "/api/generate", {"model": MODEL, "keep_alive": keep_alive})
        assert status == 403 and "keep_alive below 60s (server.min_keep_alive)" in body["error"], body
        status, body, _ = call(daemon, "POST", "/api/embed",
                               {"model": MODEL, "input": "hi", "keep_alive": keep_alive})
        assert status == 403, body
    assert [m["name"] for m in call(daemon, "GET", "/api/ps", key=OPS)[1]["models"]] == [MODEL]  # still loaded
    for keep_alive, key in (("10m", ALICE), (-1, ALICE), ("30s", OPS), ("5m", OPS)):
        status, body, _ = call(daemon, "POST", "/api/generate", {"model": MODEL, "keep_alive": keep_alive}, key=key)
        assert status == 200 and body["done_reason"] == "load", (keep_alive, key, body)


# ---------------------------------------------------------------------------- bounds

def test_stop_strings_are_bounded(daemon):
    many = ["a", "b", "c", "d", "e"]
    assert_400(call(daemon, "POST", "/api/generate", {"model": MODEL, "prompt": "Hi", "options": {"stop": many}}),
               '"options.stop" has 5 strings, more than the limit of 4 (limits.max_stop_strings)')
    assert_400(call(daemon, "POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "stop": ["x" * 33]}),
               '"stop[0]" has 33 characters, more than the limit of 32 (limits.max_stop_chars)', param="stop[0]")
    r = ollama_client(daemon).generate(MODEL, "Count: one, two,", raw=True, options={**GREEDY, "stop": many[:4]})
    assert r.done


def test_prompts_and_messages_are_bounded_before_templating(daemon):
    assert_400(call(daemon, "POST", "/api/generate", {"model": MODEL, "prompt": "x" * 3000, "system": "y" * 1001}),
               '"prompt" has 4001 characters, more than the limit of 4000 (limits.max_prompt_chars)')
    assert_400(call(daemon, "POST", "/v1/completions", {"model": MODEL, "prompt": "x" * 4001}),
               "limits.max_prompt_chars", param="prompt")
    nine = [{"role": "user", "content": "hi"}] * 9
    assert_400(call(daemon, "POST", "/api/chat", {"model": MODEL, "messages": nine}),
               '"messages" has 9 messages, more than the limit of 8 (limits.max_messages)')
    assert_400(call(daemon, "POST", "/v1/chat/completions",
                    {"model": MODEL, "messages": [{"role": "user", "content": "x" * 2001}] * 2}),
               '"messages" has 4002 characters', param="messages")


def test_prompt_chars_count_tool_descriptions_and_call_arguments(daemon):
    tool = {"type": "function", "function": {"name": "f", "description": "d" * 2000, "parameters": {}}}
    chat = [{"role": "user", "content": "x" * 2001}]
    # The tool's name counts too (1), as the call's name does below: a template writes both.
    assert_400(call(daemon, "POST", "/v1/chat/completions", {"model": MODEL, "messages": chat, "tools": [tool]}),
               '"messages" has 4002 characters, more than the limit of 4000 (limits.max_prompt_chars)',
               param="messages")
    history = [{"role": "user", "content": "x" * 2001},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"function": {"name": "f", "arguments": {"a": "y" * 1992}}}]}]  # {"a": "..."}: 2,001 characters
    assert_400(call(daemon, "POST", "/api/chat", {"model": MODEL, "messages": history}),
               '"messages" has 4003 characters, more than the limit of 4000 (limits.max_prompt_chars)')
    within = [{"role": "user", "content": "x" * 1999}]
    status, body, _ = call(daemon, "POST", "/api/chat", {"model": MODEL, "messages": within, "stream": False,
                                                         "tools": [tool], "options": GREEDY})
    assert status == 200, body  # 1,999 + 2,000 + 1: the limit


def test_embedding_inputs_are_bounded(daemon):
    assert_400(call(daemon, "POST", "/api/embed", {"model": MODEL, "input": ["a"] * 5}),
               '"input" has 5 inputs, more than the limit of 4 (limits.max_embed_inputs)')
    text = "the river runs to the sea and the sea never fills; "
    assert_400(call(daemon, "POST", "/v1/embeddings", {"model": MODEL, "input": [text * 2] * 3}),
               "tokens, more than the limit of 64 (limits.max_embed_tokens)", param="input")
    status, body, _ = call(daemon, "POST", "/api/embed", {"model": MODEL, "input": [text] * 2})
    assert status == 200 and len(body["embeddings"]) == 2


@pytest.mark.parametrize("depth", [17, 100_000])
def test_deeply_nested_json_is_a_400(daemon, depth):
    nested = "[" * depth + "]" * depth
    raw = ('{"model": "%s", "prompt": "Hi", "options": {"stop": %s}}' % (MODEL, nested)).encode()
    assert_400(call(daemon, "POST", "/api/generate", raw=raw), "deeper than the limit of 16 levels")


# ---------------------------------------------------------------------------- browsers

def test_foreign_origins_get_403_and_allowed_ones_cors(daemon):
    for origin in ("https://evil.example", "null", "http://localhost.evil.example"):
        status, body, _ = call(daemon, "POST", "/api/generate", {"model": MODEL, "prompt": "Hi"},
                               headers={"Origin": origin})
        assert status == 403 and "not allowed" in body["error"], (origin, body)
        assert call(daemon, "GET", "/api/tags", headers={"Origin": origin})[0] == 403
    for origin in ("http://localhost:5173", "http://127.0.0.1", "http://[::1]:8080", "tauri://localhost",
                   APP_ORIGIN):
        status, _, headers = call(daemon, "GET", "/api/tags", headers={"Origin": origin})
        assert status == 200 and headers["Access-Control-Allow-Origin"] == origin, (origin, headers)


def test_preflight_is_answered_for_allowed_origins_only(daemon):
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    status, _, headers = http("OPTIONS", daemon.url + "/api/chat", headers={"Origin": APP_ORIGIN, **ask})
    assert status == 204 and headers["Access-Control-Allow-Origin"] == APP_ORIGIN
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert headers["Access-Control-Allow-Headers"] == "authorization,content-type"
    assert http("OPTIONS", daemon.url + "/api/chat", headers={"Origin": "https://evil.example", **ask})[0] == 403


def test_a_streamed_answer_carries_cors_headers(daemon):
    conn = HTTPConnection("127.0.0.1", int(daemon.host.split(":")[1]), timeout=120)
    body = {"model": MODEL, "prompt": "Hi", "options": {"num_predict": 2}}
    conn.request("POST", "/api/generate", json.dumps(body), {"Authorization": f"Bearer {ALICE}",
                                                             "Content-Type": "application/json",
                                                             "Origin": "http://localhost:3000"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Access-Control-Allow-Origin") == "http://localhost:3000"
    assert json.loads(resp.read().splitlines()[-1])["done"] is True
    conn.close()


def test_dns_rebinding_hosts_get_403(daemon):
    port = daemon.host.split(":")[1]
    status, body, _ = call(daemon, "GET", "/api/tags", headers={"Host": f"rebind.evil.example:{port}"})
    assert status == 403 and "loopback" in body["error"]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "localhost"):
        assert call(daemon, "GET", "/api/tags", headers={"Host": host})[0] == 200, host


def test_browser_bodies_must_be_json(daemon):
    body = json.dumps({"model": MODEL, "prompt": "Hi", "stream": False, "options": {"num_predict": 1}}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        status, reply, _ = call(daemon, "POST", "/api/generate", raw=body,
                                headers={"Content-Type": content_type, "Origin": "http://localhost:3000"})
        assert status == 415 and "application/json" in reply["error"], (content_type, reply)
        status, _, _ = call(daemon, "POST", "/api/generate", raw=body,
                            headers={"Content-Type": content_type, "Sec-Fetch-Site": "cross-site"})
        assert status == 415
    # Not a browser: curl -d sends a form content type, and Ollama's clients have always worked so.
    status, reply, _ = call(daemon, "POST", "/api/generate", raw=body,
                            headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 200 and reply["done"], reply


# ---------------------------------------------------------------------------- the victim

def test_a_victims_greedy_stream_is_exact_while_attackers_are_refused(daemon):
    reference = call(daemon, "POST", "/api/generate", {"model": MODEL, "prompt": STORY, "stream": False,
                                                       "options": {"temperature": 0, "num_predict": 40}})[1]["response"]
    conn = HTTPConnection("127.0.0.1", int(daemon.host.split(":")[1]), timeout=120)
    conn.request("POST", "/api/generate", json.dumps({"model": MODEL, "prompt": STORY, "options": {
        "temperature": 0, "num_predict": 40}}), {"Authorization": f"Bearer {OPS}", "Content-Type": "application/json"})
    resp = conn.getresponse()
    first = json.loads(resp.readline())
    attacks = [
        ("/api/generate", {"model": MODEL, "prompt": "Hi", "options": {"repeat_penalty": 1e-40}}),
        ("/api/generate", {"model": MODEL, "prompt": "Hi", "keep_alive": "1ms"}),
        ("/api/generate", {"model": MODEL, "keep_alive": "nan"}),
        ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 50}),
        ("/api/embed", {"model": MODEL, "input": ["x"] * 50}),
    ]
    for path, body in attacks:
        assert call(daemon, "POST", path, body)[0] in (400, 403), (path, body)
    served = ollama_client(daemon).generate(MODEL, "Hi", options={"temperature": 1e-40, "num_predict": 4})
    assert served.done
    rest = [json.loads(line) for line in resp]
    conn.close()
    assert first["response"] + "".join(c["response"] for c in rest) == reference
    assert rest[-1]["done"] is True
    assert http("GET", daemon.url + "/health")[0] == 200


def test_show_gives_other_tenants_the_file_name_only(daemon):
    def source(key):
        status, body, _ = call(daemon, "POST", "/api/show", {"model": MODEL}, key=key)
        assert status == 200, body
        return next(line[5:] for line in body["modelfile"].splitlines() if line.startswith("FROM "))

    admin_sees, alice_sees = source(OPS), source(ALICE)
    assert admin_sees.startswith("/") and admin_sees.endswith(".gguf")
    assert alice_sees == admin_sees.rsplit("/", 1)[1]


def test_a_tenant_at_its_limit_is_refused_before_its_body_is_read(daemon):
    held = HTTPConnection("127.0.0.1", int(daemon.host.split(":")[1]), timeout=120)
    held.request("POST", "/api/generate", json.dumps({"model": MODEL, "prompt": STORY, "options": {"num_predict": 500}}),
                 {"Authorization": f"Bearer {SOLO}", "Content-Type": "application/json"})
    resp = held.getresponse()
    assert resp.status == 200 and json.loads(resp.readline())["done"] is False
    try:
        # Not even JSON: the 429 comes before the body is read, so a flood of them costs little.
        status, body, headers = call(daemon, "POST", "/api/generate", key=SOLO, raw=b"{not json" * 1000)
        assert status == 429 and "max_concurrent limit of 1" in body["error"] and headers["Retry-After"] == "1"
        status, body, _ = call(daemon, "POST", "/v1/chat/completions", key=SOLO, raw=b"{not json")
        assert status == 429 and body["error"]["code"] == "max_concurrent"
    finally:
        held.sock.shutdown(2)
        held.close()
    small = {"model": MODEL, "prompt": "Hi", "stream": False, "options": {"num_predict": 1}}
    assert wait_for(lambda: call(daemon, "POST", "/api/generate", small, key=SOLO)[0] == 200, 30)
    assert call(daemon, "POST", "/api/generate", key=SOLO, raw=b"{not json")[0] == 400


@pytest.mark.slow
def test_a_client_that_stops_reading_is_dropped_and_frees_its_slot(daemon):
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # before connecting: a small window
    stalled.connect(("127.0.0.1", int(daemon.host.split(":")[1])))
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True,
                       "temperature": 0, "stream": True}).encode()
    stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Authorization: Bearer " + SOLO.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    try:  # ...and never reads: once the socket's buffers are full, writes stall
        small = {"model": MODEL, "prompt": "Hi", "stream": False, "options": {"num_predict": 1}}
        assert wait_for(lambda: call(daemon, "POST", "/api/generate", small, key=SOLO)[0] == 429, 60)
        assert wait_for(lambda: call(daemon, "POST", "/api/generate", small, key=SOLO)[0] == 200, 300, 1)
        assert "read nothing for 2s; dropping its stream" in daemon.log()
        assert call(daemon, "GET", "/api/ps", key=OPS)[1]["models"][0]["kv_blocks_used"] == 0
    finally:
        stalled.close()
