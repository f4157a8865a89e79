"""Tenants on a live daemon: API keys (401), model allow-lists (403), limits (429 with Retry-After),
per-tenant /api/ps rows, and `gpushare ps --tenants` -- in both dialects' error shapes.

One daemon for the module (SmolLM2-135M on CPU) with a tenant per behaviour; answers are a
few tokens. A running request is held open by streaming a long answer and reading only its
first chunk; closing the connection cancels it.
"""

import asyncio
import hashlib
import json
import time

import ollama
import openai
import pytest
from daemon_fixture import MODEL, http, long_stream, serving, wait_for

from gpushare import cli
from gpushare.api.context import ApiContext
from gpushare.api.errors import ApiError
from gpushare.api.tenants import apply_tenant_settings
from gpushare.settings.settings import parse_settings
from gpushare.engine.local_device import LocalDevice
from gpushare.residency.node_devices import NodeDevices

BOB_KEY = "bob-key"
TENANTS = [
    {"name": "alice", "api_keys": ["alice-key"]},
    {"name": "bob", "api_keys": ["sha256:" + hashlib.sha256(BOB_KEY.encode()).hexdigest()]},
    {"name": "carol", "api_keys": ["carol-key"], "models": ["llama3*"]},
    {"name": "slow", "api_keys": ["slow-key"], "rate_limit": {"requests_per_s": 0.05}},
    {"name": "thrifty", "api_keys": ["thrifty-key"], "rate_limit": {"tokens_per_min": 60}},
    {"name": "solo", "api_keys": ["solo-key"], "max_concurrent": 1, "max_queued": 0},
    {"name": "queue", "api_keys": ["queue-key"], "max_concurrent": 1, "max_queued": 1},
    {"name": "ops", "api_keys": ["ops-key"], "admin": True},
    {"name": "tiny", "api_keys": ["tiny-key"], "kv_limit": "32tok"},
]
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}]}


def call(daemon, method: str, path: str, body=None, key: str | None = None, header: str = "Authorization"):
    """(status, parsed JSON, headers) for one request, with the key in `header` when given."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers[header] = f"Bearer {key}" if header == "Authorization" else key
    return http(method, daemon.url + path, body, headers=headers)


def ollama_chat(tokens: int = 1) -> dict:
    return {**CHAT, "stream": False, "options": {"temperature": 0, "num_predict": tokens}}


def openai_chat(tokens: int = 1) -> dict:
    return {**CHAT, "temperature": 0, "max_tokens": tokens}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, smollm2_path):
    with serving(tmp_path_factory.mktemp("tenants"), smollm2_path, {"tenants": TENANTS}) as d:
        yield d


class HeldRequest:
    """A long streamed generation of `key`'s tenant (daemon_fixture.long_stream: it cannot end on its
    own while a test holds it), kept running (or queued) until closed."""

    def __init__(self, daemon, key: str, wait_for_first_chunk: bool = True):
        self.conn = long_stream(daemon, key, wait_for_first_chunk)

    def close(self) -> None:
        self.conn.sock.shutdown(2)
        self.conn.close()


def tenant_row(daemon, key: str) -> dict:
    (row,) = call(daemon, "GET", "/api/ps", key=key)[1]["tenants"]
    return row


def assert_both_dialects(daemon, key: str, status: int, code: str, *fragments: str, retry_after=None):
    """The same refusal on /v1 (OpenAI's error object) and /api (Ollama's error string)."""
    s, body, headers = call(daemon, "POST", "/v1/chat/completions", openai_chat(), key=key)
    assert s == status, body
    err = body["error"]
    assert err["code"] == code and all(f in err["message"] for f in fragments), err
    assert err["type"] == ("rate_limit_error" if status == 429 else "invalid_request_error")
    s, body, headers_ollama = call(daemon, "POST", "/api/chat", ollama_chat(), key=key)
    assert s == status and isinstance(body["error"], str), body
    assert all(f in body["error"] for f in fragments), body
    for h in (headers, headers_ollama):
        if retry_after is None:
            assert "Retry-After" not in h
        else:
            assert retry_after[0] <= int(h["Retry-After"]) <= retry_after[1], h
    return headers


def test_a_key_is_required_and_checked(daemon):
    for key in (None, "wrong-key"):
        expected, code = ("missing API key", "missing_api_key") if key is None else \
            ("invalid API key", "invalid_api_key")
        status, body, headers = call(daemon, "GET", "/v1/models", key=key)
        assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
        assert body["error"]["code"] == code and expected in body["error"]["message"]
        status, body, _ = call(daemon, "POST", "/api/chat", ollama_chat(), key=key)
        assert status == 401 and expected in body["error"]
    assert call(daemon, "GET", "/api/version")[0] == 200  # probes need no key


def test_keys_work_in_either_header_and_as_sha256_digests(daemon):
    status, body, _ = call(daemon, "POST", "/api/chat", ollama_chat(2), key="alice-key")
    assert status == 200 and body["done"] and body["eval_count"] >= 1
    status, body, _ = call(daemon, "POST", "/api/chat", ollama_chat(2), key=BOB_KEY, header="x-api-key")
    assert status == 200 and body["done"]
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key=BOB_KEY, max_retries=0, timeout=120)
    r = client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=2, temperature=0)
    assert r.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=daemon.url + "/v1", api_key="sha256:" + hashlib.sha256(BOB_KEY.encode()).hexdigest(),
                      max_retries=0).models.list()  # the digest itself is not a key


def test_embedding_inputs_count_against_the_tenants_kv_limit(daemon):
    text = "the river runs to the sea and the sea never fills; " * 4
    status, body, _ = call(daemon, "POST", "/api/embed", {"model": MODEL, "input": text}, key="tiny-key")
    assert status == 400 and "tenant 'tiny'" in body["error"] and "kv_limit (32 tokens)" in body["error"]
    status, body, _ = call(daemon, "POST", "/api/embed", {"model": MODEL, "input": "the river"}, key="tiny-key")
    assert status == 200 and len(body["embeddings"][0]) == 576


def test_only_an_admin_may_unload_with_keep_alive_0(daemon):
    for path, body in (("/api/generate", {"model": MODEL, "keep_alive": 0}),
                       ("/api/chat", {**ollama_chat(), "keep_alive": 0}),
                       ("/api/embed", {"model": MODEL, "input": "hi", "keep_alive": 0})):
        status, reply, _ = call(daemon, "POST", path, body, key="alice-key")
        assert status == 403 and 'tenant "alice" may not unload models' in reply["error"], (path, reply)
    assert [m["name"] for m in call(daemon, "GET", "/api/ps", key="alice-key")[1]["models"]] == [MODEL]


def test_a_model_outside_the_allow_list_is_403_and_unlisted(daemon):
    assert_both_dialects(daemon, "carol-key", 403, "model_not_allowed", 'tenant "carol" may not use model')
    assert call(daemon, "GET", "/api/tags", key="carol-key")[1]["models"] == []
    assert call(daemon, "GET", "/v1/models", key="carol-key")[1]["data"] == []
    assert [m["name"] for m in call(daemon, "GET", "/api/tags", key="alice-key")[1]["models"]] == [MODEL]
    client = ollama.Client(host=daemon.url, headers={"Authorization": "Bearer carol-key"})
    with pytest.raises(ollama.ResponseError) as info:
        client.show(MODEL)
    assert info.value.status_code == 403


def test_over_requests_per_s_is_429_with_retry_after(daemon):
    assert call(daemon, "POST", "/api/chat", ollama_chat(), key="slow-key")[0] == 200  # the bucket's one
    assert_both_dialects(daemon, "slow-key", 429, "requests_per_s", 'tenant "slow"', "0.05 requests per second",
                         retry_after=(15, 20))


def test_over_tokens_per_min_is_429_with_retry_after(daemon):
    status, body, _ = call(daemon, "POST", "/v1/chat/completions", openai_chat(1), key="thrifty-key")
    assert status == 200
    spent = body["usage"]["total_tokens"]  # prompt + 1 of the 60-token bucket
    s, body, headers = call(daemon, "POST", "/v1/chat/completions", openai_chat(200), key="thrifty-key")
    # Dearer than the bucket: it waits for a full bucket, i.e. for the `spent` tokens to come back.
    assert s == 429 and body["error"]["code"] == "tokens_per_min" and "60 tokens per minute" in body["error"]["message"]
    assert spent - 2 <= int(headers["Retry-After"]) <= spent + 1
    s, body, _ = call(daemon, "POST", "/api/chat", {**ollama_chat(), "options": {"num_predict": 200}},
                      key="thrifty-key")
    assert s == 429 and "tokens_per_min" in body["error"]


def test_over_max_concurrent_is_429_at_once(daemon):
    held = HeldRequest(daemon, "solo-key")
    try:
        t0 = time.monotonic()
        assert_both_dialects(daemon, "solo-key", 429, "max_concurrent", "max_concurrent limit of 1", retry_after=(1, 1))
        assert time.monotonic() - t0 < 5
        assert call(daemon, "POST", "/api/chat", ollama_chat(), key="alice-key")[0] == 200  # others go on
    finally:
        held.close()
    assert wait_for(lambda: tenant_row(daemon, "solo-key")["requests"] == 0, timeout_s=10)
    assert call(daemon, "POST", "/api/chat", ollama_chat(), key="solo-key")[0] == 200


def test_over_max_queued_is_429_and_queued_requests_wait(daemon):
    running = HeldRequest(daemon, "queue-key")
    queued = HeldRequest(daemon, "queue-key", wait_for_first_chunk=False)
    try:
        row = wait_for(lambda: (r := tenant_row(daemon, "queue-key"))["queued"] == 1 and r, timeout_s=10)
        assert row and row["running"] == 1 and row["requests"] == 2, row
        assert_both_dialects(daemon, "queue-key", 429, "max_queued", "max_queued limit of 1", retry_after=(1, 1))
    finally:
        queued.close()
        running.close()
    assert wait_for(lambda: tenant_row(daemon, "queue-key")["requests"] == 0, timeout_s=10)


def test_ps_shows_a_tenant_only_its_own_row(daemon):
    call(daemon, "POST", "/api/chat", ollama_chat(3), key="alice-key")
    row = tenant_row(daemon, "alice-key")
    assert row["name"] == "alice" and row["generated_tokens"] >= 1 and row["computed_tokens"] > row["generated_tokens"]
    assert row["kv_limit_bytes"] is None and row["running"] == 0 and row["queued"] == 0
    assert [r["name"] for r in call(daemon, "GET", "/api/ps", key=BOB_KEY)[1]["tenants"]] == ["bob"]
    everyone = call(daemon, "GET", "/api/ps", key="ops-key")[1]["tenants"]
    assert [r["name"] for r in everyone] == [t["name"] for t in TENANTS]


def test_only_an_admin_may_create_models(daemon, smollm2_path):
    status, body, _ = call(daemon, "POST", "/api/create", {"model": "mine", "from": smollm2_path}, key="alice-key")
    assert status == 403 and "admin" in body["error"]


def test_cli_ps_tenants_sends_the_key(daemon, monkeypatch, capsys):
    monkeypatch.setenv("GPUSHARE_HOST", daemon.host)
    monkeypatch.delenv("GPUSHARE_API_KEY", raising=False)
    assert cli.main(["ps", "--tenants"]) == 1
    assert "missing API key" in capsys.readouterr().err
    monkeypatch.setenv("GPUSHARE_API_KEY", "alice-key")
    assert cli.main(["ps", "--tenants"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split()[:4] == ["TENANT", "KV", "USED", "KV"] and len(rows) == 1 and rows[0].startswith("alice")
    assert cli.main(["ps", "--tenants", "--json"]) == 0
    assert [t["name"] for t in json.loads(capsys.readouterr().out)["tenants"]] == ["alice"]


def test_reload_applies_new_limits_live_and_keeps_admitted_requests():
    """What a SIGHUP does: apply_tenant_settings on a running API context and engine (no model needed)."""
    from gpushare.engine.engine import Engine

    def settings(max_concurrent: int, max_queued: int, names=("a", "b")):
        return parse_settings({"models": [], "tenants": [
            {"name": n, "api_keys": [f"{n}-key"], "max_concurrent": max_concurrent, "max_queued": max_queued,
             "kv_limit": "1GiB"} for n in names]}, env={})

    engine = Engine()
    ctx = ApiContext(NodeDevices({"cpu": LocalDevice(engine)}), registry=None, settings=settings(2, 0))

    async def scenario():
        apply_tenant_settings(ctx, ctx.settings)
        a = ctx.tenants.identify("a-key")
        await a.acquire()
        await a.acquire()
        apply_tenant_settings(ctx, settings(1, 0, names=("a",)))  # fewer slots; b removed
        assert ctx.tenants.identify("a-key") is a and a.running == 2  # admitted requests keep their slots
        with pytest.raises(ApiError) as info:
            await a.acquire()
        assert (info.value.status, info.value.code) == (429, "max_concurrent")
        with pytest.raises(ApiError) as info:
            ctx.tenants.identify("b-key")
        assert info.value.status == 401
        a.release()
        a.release()
        apply_tenant_settings(ctx, settings(1, 1, names=("a",)))
        await a.acquire()
        queued = asyncio.create_task(a.acquire())
        await asyncio.sleep(0)
        assert not queued.done() and len(a.waiters) == 1
        apply_tenant_settings(ctx, settings(2, 1, names=("a",)))  # a slot more: the queued request runs
        await asyncio.wait_for(queued, 1)
        assert a.running == 2 and not a.waiters

    asyncio.run(scenario())
    # The engine takes new policies before its next step; its snapshot shows them after that turn.
    deadline_s = time.monotonic() + 10
    while "a" not in engine.tenant_stats() and time.monotonic() < deadline_s:
        time.sleep(0.01)
    stats = engine.tenant_stats()
    assert stats["a"].kv_limit_bytes == 1 << 30 and "b" not in stats


def test_without_tenants_everyone_is_the_default_tenant_and_needs_no_key():
    """Ollama's behaviour: no keys; /api/ps has the one "default" row (in-process app, no model)."""
    from aiohttp.test_utils import TestClient, TestServer

    from gpushare.api.app import build_app
    from gpushare.engine.engine import Engine
    from gpushare.residency.registry import Registry

    settings = parse_settings({"models": []}, env={})
    devices = {"cpu": LocalDevice(Engine())}
    app = build_app(ApiContext(NodeDevices(devices), Registry(devices, settings, dtype="float32"), settings))

    async def scenario():
        async with TestClient(TestServer(app)) as client:
            for headers in ({}, {"Authorization": "Bearer anything"}):
                resp = await client.get("/api/ps", headers=headers)
                assert resp.status == 200
                (row,) = (await resp.json())["tenants"]
                assert row["name"] == "default" and row["kv_limit_bytes"] is None and row["requests"] == 0

    asyncio.run(scenario())
