"""Bursts wait in the daemon, within bounds that are settings (issue 67), on live daemons (real HTTP,
real SmolLM2): 512 streaming chats sent at once to the default engine settings are all answered
in full; past `server.max_queued` waiting jobs of the work pool (api/work.py) a request gets 503
with Retry-After and a JSON body; past `server.max_body_bytes_held` of bodies held a body is
refused (503, or 413 when it alone is larger) and the bytes held never pass the bound; and one
tenant's burst does not hold back another tenant's request, whose preparation takes its turn
before the burst's tail.

Preparation is the bottleneck only when templates are slow: the tests that need the pool busy use
a model whose chat template loops (a Jinja2 loop of 10^6 steps, or one that never ends until
its client leaves), never a wall-clock assertion.
"""

import asyncio
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPConnection

import aiohttp
import pytest
from daemon_fixture import MODEL, http, serving, wait_for
from test_loop_bounds import SLOW_TEMPLATE, template_children

from gpushare.catalog.chat_template import DEFAULT_TEMPLATE

BURST = 512
PROMPTS = [f"Name a colour, then count to {n}." for n in range(8)]  # a few distinct prompts, cycled
MAX_QUEUED = 24
HELD_BYTES = 1 << 20
SLOW = "slow-template"
# "forever": two nested loops of 10^10 steps, until the client leaves; any other chat: 10^6 steps first.
SLOW_SOURCE = ("{% if messages and messages[-1]['content'] == 'forever' %}" + SLOW_TEMPLATE +
               "{% else %}{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}{% endif %}" +
               DEFAULT_TEMPLATE)
TENANTS = [{"name": "a", "api_keys": ["a-key"]}, {"name": "b", "api_keys": ["b-key"]},
           {"name": "ops", "api_keys": ["ops-key"], "admin": True}]


@pytest.fixture(scope="module")
def default_daemon(tmp_path_factory, smollm2_path):
    """The engine's default settings (the test config's small engine replaced by the defaults)."""
    overrides = {"engine": {"max_num_seqs": 64, "max_num_batched_tokens": 2048}, "memory": {"kv_budget": "2GiB"}}
    with serving(tmp_path_factory.mktemp("bursts"), smollm2_path, overrides) as d:
        yield d


@pytest.fixture(scope="module")
def bounded_daemon(tmp_path_factory, smollm2_path):
    overrides = {"server": {"max_queued": MAX_QUEUED, "max_body_bytes_held": HELD_BYTES},
                 "limits": {"work_timeout": "60s"}, "tenants": TENANTS}
    with serving(tmp_path_factory.mktemp("bursts-bounded"), smollm2_path, overrides) as d:
        status, body, _ = http("POST", d.url + "/api/create", {"model": SLOW, "from": MODEL, "template": SLOW_SOURCE,
                                                               "stream": False}, headers=auth("ops-key"))
        assert status == 200, body
        assert http("POST", d.url + "/api/chat", {"model": SLOW, "messages": []}, headers=auth("ops-key"))[0] == 200
        yield d


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def chat_body(prompt: str, model: str = MODEL, stream: bool = True) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": stream,
            "options": {"temperature": 0, "num_predict": 4}}


async def streamed_chat(session: aiohttp.ClientSession, url: str, prompt: str) -> tuple[int, str, bool]:
    """(status, the streamed text, whether the stream ended with done)."""
    async with session.post(url + "/api/chat", json=chat_body(prompt)) as resp:
        if resp.status != 200:
            return resp.status, await resp.text(), False
        text, done = "", False
        async for line in resp.content:
            if line.strip():
                item = json.loads(line)
                text += item.get("message", {}).get("content", "")
                done = done or item.get("done", False)
        return resp.status, text, done


async def burst(url: str, prompts: list[str]) -> list[tuple[int, str, bool]]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        return await asyncio.gather(*(streamed_chat(session, url, p) for p in prompts))


def test_512_streaming_chats_sent_at_once_are_all_answered_in_full(default_daemon):
    expected = {}
    for prompt in PROMPTS:
        status, body, _ = http("POST", default_daemon.url + "/api/chat", chat_body(prompt, stream=False))
        assert status == 200, body
        expected[prompt] = body["message"]["content"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(BURST)]
    results = asyncio.run(burst(default_daemon.url, prompts))
    refused = [(status, text) for status, text, _ in results if status != 200]
    assert not refused, f"{len(refused)} of {BURST} refused, e.g. {refused[0]}"
    assert all(done for _, _, done in results)
    wrong = [(p, text) for p, (_, text, _) in zip(prompts, results) if text != expected[p]]
    assert not wrong, f"{len(wrong)} answers differ from the one sent alone, e.g. {wrong[0]} vs {expected[wrong[0][0]]!r}"


def metric(daemon, name: str) -> float:
    status, text, _ = http("GET", daemon.url + "/metrics", headers=auth("ops-key"))
    assert status == 200, text
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def open_chat(daemon, key: str, body: dict) -> HTTPConnection:
    conn = HTTPConnection("127.0.0.1", int(daemon.host.split(":")[1]), timeout=120)
    conn.request("POST", "/api/chat", json.dumps(body), {"Content-Type": "application/json", **auth(key)})
    return conn


def answer(conn: HTTPConnection) -> tuple[int, str, dict]:
    resp = conn.getresponse()
    return resp.status, resp.read().decode(), dict(resp.headers)


def test_past_max_queued_waiting_jobs_the_answer_is_503_with_retry_after(bounded_daemon):
    d = bounded_daemon
    # Four chats whose templates never end take the pool's four threads until their clients leave.
    before = {pid: user_s for pid, (_, user_s) in template_children(d).items()}
    blockers = [open_chat(d, "ops-key", chat_body("forever", SLOW, stream=False)) for _ in range(4)]
    try:
        assert wait_for(lambda: len([pid for pid, (_, user_s) in template_children(d).items()
                                     if user_s - before.get(pid, 0) > 0.3]) == 4, timeout_s=60), \
            "the four endless templates did not all start rendering"
        assert metric(d, "gpushare_work_running") == 4
        waiting = [open_chat(d, "a-key", chat_body(PROMPTS[0], stream=False)) for _ in range(MAX_QUEUED + 3)]
        with ThreadPoolExecutor(len(waiting)) as pool:
            answers = [pool.submit(answer, conn) for conn in waiting]
            refusals = wait_for(lambda: [a.result() for a in answers if a.done()] if sum(a.done() for a in answers)
                                >= 3 else None, timeout_s=30)
            assert refusals and len(refusals) == 3, "no request was refused past server.max_queued"
            for status, text, headers in refusals:
                assert status == 503 and headers.get("Retry-After") == "1", (status, text, headers)
                assert "server.max_queued" in json.loads(text)["error"], text
            assert metric(d, "gpushare_work_queued") == MAX_QUEUED
            for conn in blockers:  # their clients leave: the renders stop, the queue moves
                conn.close()
            statuses = sorted(a.result()[0] for a in answers)
        assert statuses == [200] * MAX_QUEUED + [503] * 3
    finally:
        for conn in blockers:
            conn.close()


def test_a_tenants_burst_leaves_another_tenants_request_its_turn(bounded_daemon):
    """Tenant a sends 20 token counts (Anthropic's count_tokens: the whole preparation, no engine) whose
    template takes 10^6 Jinja2 steps each; once they queue, tenant b sends one. b's jobs take the
    next free thread, not the place behind a's 20: b is answered before most of a's burst (first in,
    first out it would come last)."""
    d = bounded_daemon
    order, lock = [], threading.Lock()

    def count(key: str, model: str, text: str) -> None:
        status, reply, _ = http("POST", d.url + "/v1/messages/count_tokens",
                                {"model": model, "messages": [{"role": "user", "content": text}]}, headers=auth(key))
        with lock:
            order.append((key, status, reply))

    burst_size = 20
    with ThreadPoolExecutor(burst_size + 1) as pool:
        sent = [pool.submit(count, "a-key", SLOW, f"burst {i}") for i in range(burst_size)]
        assert wait_for(lambda: metric(d, "gpushare_work_queued") >= burst_size // 2, timeout_s=30), \
            "the burst did not queue"
        sent.append(pool.submit(count, "b-key", MODEL, PROMPTS[1]))
        for future in sent:
            future.result()
    assert all(status == 200 for _, status, _ in order), [reply for _, status, reply in order if status != 200]
    place = next(i for i, (key, _, _) in enumerate(order) if key == "b-key")
    assert place < burst_size // 2, f"tenant b was answered after {place} of tenant a's {burst_size} requests"


def slow_upload(daemon, declared: int) -> socket.socket:
    """A chat whose headers declare ``declared`` bytes and whose body comes one byte, then stops."""
    sock = socket.create_connection(("127.0.0.1", int(daemon.host.split(":")[1])), timeout=60)
    sock.sendall(f"POST /api/chat HTTP/1.1\r\nHost: {daemon.host}\r\nAuthorization: Bearer a-key\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n{{".encode())
    return sock


def test_bodies_held_stay_within_max_body_bytes_held(bounded_daemon):
    d = bounded_daemon
    big = json.dumps(chat_body("x" * (HELD_BYTES + 10), stream=False))
    status, body, _ = http("POST", d.url + "/api/chat", big.encode(), headers=auth("a-key"))
    assert status == 413 and "server.max_body_bytes_held" in body["error"], (status, body)
    # Five uploads of 200 KiB that stall hold 1,000 KiB of the 1,024; a sixth would pass the bound.
    stalled = [slow_upload(d, 200 << 10) for _ in range(5)]
    try:
        assert wait_for(lambda: metric(d, "gpushare_body_bytes_held") == 5 * (200 << 10), timeout_s=30)
        status, body, headers = http("POST", d.url + "/api/chat", json.dumps(chat_body("y" * (100 << 10),
                                     stream=False)).encode(), headers=auth("a-key"))
        assert status == 503 and headers.get("Retry-After") == "1", (status, body)
        assert "server.max_body_bytes_held" in body["error"], body
        assert metric(d, "gpushare_body_bytes_held") <= HELD_BYTES
    finally:
        for sock in stalled:
            sock.close()
    assert wait_for(lambda: metric(d, "gpushare_body_bytes_held") == 0, timeout_s=30), "the bytes were not given back"
    status, body, _ = http("POST", d.url + "/api/chat", chat_body(PROMPTS[2], stream=False), headers=auth("a-key"))
    assert status == 200, body
