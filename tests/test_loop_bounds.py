"""Nothing unbounded runs on the HTTP event loop (issue 34): each attack, sent to a live daemon (real
HTTP, real SmolLM2), ends in a 4xx whose JSON body names the limit, while a poller on /api/version
(one keep-alive connection) sees every answer within 250 ms (less waits for a CPU: see POLLER); the
daemon answers greedy-exact after.

The attacks are the sizes the review measured: 3,000 tools, a schema of 20,000 properties, a 64 MiB
body of nested empty objects, a huge token-id prompt, and a chat template that never ends (here
also left by its client: the process rendering it must be gone within seconds, not burn on).
"""

import json
import subprocess
import sys
import time
from contextlib import contextmanager
from http.client import HTTPConnection

import psutil
import pytest
from daemon_fixture import MODEL, http, serving, wait_for

from gpushare import SamplingParams

MIB = 1 << 20
WORK_TIMEOUT_S = 6
MAX_STALL_S = 0.25
SLOW = "slow-template"
# 10^10 loop steps and no output: it would run for hours (Jinja2's sandbox caps one range at 100,000 items).
SLOW_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
PROBE = "The capital of France is"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, smollm2_path, request):
    overrides = {"limits": {"work_timeout": f"{WORK_TIMEOUT_S}s"}}
    with serving(tmp_path_factory.mktemp("loop-bounds"), smollm2_path, overrides,
                 while_loading=lambda: request.getfixturevalue("served_llm")) as d:
        yield d


@pytest.fixture(scope="module")
def expected(served_llm) -> str:
    return served_llm.generate(PROBE, SamplingParams(temperature=0, max_tokens=8))[0].text


# The poller runs in its own process, so that the test's own work (building and sending 64 MiB) does
# not delay it. Each answer's time is counted less the time the daemon's event-loop thread and the
# poller itself spent runnable but waiting for a CPU (/proc/<tid>/schedstat): on this shared machine
# that is other work's, not the loop's. A loop held by a computation, or waiting for the GIL, is not
# waiting for a CPU, and counts. It polls until its stdin closes, then prints
# {"slowest_s", "slowest_raw_s", "answers", "failures"}.
POLLER = """
import http.client, json, sys, threading, time
port, daemon_pid = int(sys.argv[1]), int(sys.argv[2])
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()

def queued_s():
    paths = (f"/proc/{daemon_pid}/task/{daemon_pid}/schedstat", "/proc/thread-self/schedstat")
    return sum(int(open(path).read().split()[1]) for path in paths) / 1e9

slowest, slowest_raw, answers, failures = 0.0, 0.0, 0, []
while not stop.is_set():
    queued, started = queued_s(), time.monotonic()
    conn.request("GET", "/api/version")
    resp = conn.getresponse()
    body = resp.read()
    took = time.monotonic() - started
    slowest, slowest_raw = max(slowest, took - (queued_s() - queued)), max(slowest_raw, took)
    answers += 1
    if resp.status != 200:
        failures.append(body.decode())
    time.sleep(0.01)
print(json.dumps({"slowest_s": slowest, "slowest_raw_s": slowest_raw, "answers": answers, "failures": failures}))
"""


@contextmanager
def polled(daemon):
    """Polls /api/version during the block; then asserts every answer came within MAX_STALL_S."""
    poller = subprocess.Popen([sys.executable, "-c", POLLER, daemon.host.split(":")[1], str(daemon.proc.pid)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)  # started, and a few answers before the attack
    try:
        yield
    finally:
        out, _ = poller.communicate("", timeout=60)
    result = json.loads(out)
    assert result["answers"] > 5 and not result["failures"], result
    assert result["slowest_s"] < MAX_STALL_S, (f"/api/version took {result['slowest_s']:.3f}s during the attack, "
                                               f"{result['slowest_raw_s']:.3f}s with waits for a CPU")


def post_raw(daemon, path: str, raw: bytes):
    return http("POST", daemon.url + path, raw, headers={"Content-Type": "application/json"})


def message(body) -> str:
    return body["error"]["message"] if isinstance(body["error"], dict) else body["error"]


def assert_refused(reply, status: int, *fragments):
    code, body, _ = reply
    assert code == status, body
    assert all(f in message(body) for f in fragments), message(body)


def assert_exact(daemon, expected):
    status, body, _ = http("POST", daemon.url + "/api/generate", {"model": MODEL, "prompt": PROBE, "raw": True,
                                                                "stream": False,
                                                                "options": {"temperature": 0, "num_predict": 8}})
    assert status == 200 and body["response"] == expected, body


def chat(model=MODEL, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "stream": False, **extra}


def test_3000_tools_are_refused_by_count(daemon, expected):
    tool = {"type": "function", "function": {"name": "f", "description": "a tool",
                                             "parameters": {"type": "object",
                                                            "properties": {"x": {"type": "string"}}}}}
    tools = [{**tool, "function": {**tool["function"], "name": f"f{i}"}} for i in range(3000)]
    with polled(daemon):
        assert_refused(http("POST", daemon.url + "/v1/chat/completions", chat(tools=tools, tool_choice="required")),
                       400, '"tools" has 3000 tools, more than the limit of 128 (limits.max_tools)')
        assert_refused(http("POST", daemon.url + "/api/chat", chat(tools=tools)), 400, "limits.max_tools")
    assert_exact(daemon, expected)


def test_tools_whose_schemas_are_too_big_together_are_refused(daemon, expected):
    properties = {f"p{i}": {"type": "string"} for i in range(1000)}  # ~28,000 characters each
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object",
                                                                             "properties": properties}}}
             for i in range(6)]
    with polled(daemon):
        assert_refused(http("POST", daemon.url + "/api/chat", chat(tools=tools)), 400,
                       "more than 131072 characters of JSON together", "limits.max_schema_chars", "by tools[4]")
    assert_exact(daemon, expected)


def test_a_20000_property_schema_is_refused_by_size(daemon, expected):
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20000)}}
    with polled(daemon):
        assert_refused(http("POST", daemon.url + "/api/chat", chat(format=schema)), 400,
                       '"format" is 588924 characters of JSON, more than the limit of 131072 '
                       '(limits.max_schema_chars)')
        body = chat(response_format={"type": "json_schema", "json_schema": {"name": "big", "schema": schema}})
        assert_refused(http("POST", daemon.url + "/v1/chat/completions", body), 400,
                       '"response_format.json_schema.schema" is 588924 characters', "limits.max_schema_chars")
    assert_exact(daemon, expected)


def test_a_64_mib_body_of_nested_empty_objects_is_refused_before_parsing(daemon, expected):
    head, tail = json.dumps(chat())[:-1].encode() + b', "x": [', b"]}"
    item = b'{"a":{}},'
    count = (64 * MIB - len(head) - len(tail) - 8) // len(item)
    raw = head + item * count + b'{"a":{}}' + tail
    assert len(raw) <= 64 * MIB
    too_big = raw + b" " * (64 * MIB + 1 - len(raw))
    with polled(daemon):
        assert_refused(post_raw(daemon, "/api/chat", raw), 400, "request body has more than 200000 JSON objects, "
                       "arrays and commas, the limit (limits.max_json_items)")
        assert_refused(post_raw(daemon, "/api/chat", too_big), 413,
                       "request body is larger than the limit of 67108864 bytes (limits.max_body_bytes)")
    assert_exact(daemon, expected)


def test_huge_token_id_prompts_are_refused(daemon, expected):
    fewer = json.dumps({"model": MODEL, "prompt": [1] * 150_000}).encode()  # under the JSON bound: parsed off the loop
    more = json.dumps({"model": MODEL, "prompt": [1] * 3_000_000}).encode()
    with polled(daemon):
        assert_refused(post_raw(daemon, "/v1/completions", fewer), 400,
                       "the prompt is 150000 tokens, and the usable context is")
        assert_refused(post_raw(daemon, "/v1/completions", more), 400, "limits.max_json_items")
    assert_exact(daemon, expected)


def template_children(daemon) -> dict[int, tuple[psutil.Process, float]]:
    """The daemon's template-rendering children now: pid -> (process, user CPU seconds). A child that ends
    between the listing and the reads is left out (a CI run failed on one that had: NoSuchProcess)."""
    found = {}
    for p in psutil.Process(daemon.proc.pid).children(recursive=True):
        try:
            if "gpushare.catalog.template_child" in " ".join(p.cmdline()):
                found[p.pid] = (p, p.cpu_times().user)
        except psutil.NoSuchProcess:
            pass
    return found


def test_a_template_that_never_ends_stops_at_the_limit_and_when_its_client_leaves(daemon, expected):
    status, body, _ = http("POST", daemon.url + "/api/create", {"model": SLOW, "from": MODEL,
                                                               "template": SLOW_TEMPLATE, "stream": False})
    assert status == 200, body
    assert http("POST", daemon.url + "/api/chat", {"model": SLOW, "messages": []})[0] == 200  # loaded first
    with polled(daemon):
        started = time.monotonic()
        assert_refused(http("POST", daemon.url + "/api/chat", chat(SLOW)), 400,
                       "rendering the chat template and tokenising the prompt", "took longer than the limit of "
                       f"{WORK_TIMEOUT_S}s (limits.work_timeout)")
        assert time.monotonic() - started < WORK_TIMEOUT_S + 5
    # The client leaves while its template renders: the process rendering it goes at once.
    conn = HTTPConnection("127.0.0.1", int(daemon.host.split(":")[1]), timeout=30)
    before = {pid: user_s for pid, (_, user_s) in template_children(daemon).items()}
    conn.request("POST", "/v1/chat/completions", json.dumps(chat(SLOW)), {"Content-Type": "application/json"})
    sent = time.monotonic()
    # Half a second of CPU past its start (imports take ~0.15 s): it is rendering.
    burning = wait_for(lambda: [p for pid, (p, user_s) in template_children(daemon).items()
                                if user_s - before.get(pid, 0) > 0.5], timeout_s=WORK_TIMEOUT_S)
    assert len(burning) == 1, template_children(daemon)
    conn.close()
    left = time.monotonic()
    assert left - sent < WORK_TIMEOUT_S - 2  # the client left well before the deadline would stop it
    assert wait_for(lambda: not burning[0].is_running() or burning[0].status() == psutil.STATUS_ZOMBIE,
                    timeout_s=10), "the template kept rendering after its client left"
    assert time.monotonic() - left < 2
    assert_exact(daemon, expected)
    status, body, _ = http("POST", daemon.url + "/api/chat", chat(SLOW))
    assert status == 400 and "limits.work_timeout" in message(body)  # a new child took the killed one's place
