"""Tenant admission and tenant views of issue 66, on a live daemon with tenants (docs/security.md):

- /v1/messages/count_tokens and /api/show count against requests_per_s and hold a max_concurrent
  slot, so a flood of them from one tenant is refused at its limit and another tenant's chat goes on;
- /api/status shows a tenant that is not an admin its own share of a model another tenant is
  generating on, and only the models it may use;
- HEAD /api/blobs/<digest> answers admins only: to a tenant it is the same 403 whether or not
  the blob is stored;
- the Anthropic API's limits count what is rendered: each tool_result block is a message under
  limits.max_messages, and history tool_use names count under limits.max_prompt_chars.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import anthropic
import pytest
from daemon_fixture import MODEL, http, long_stream, serving, wait_for

TENANTS = [
    {"name": "alice", "api_keys": ["alice-key"]},
    {"name": "bob", "api_keys": ["bob-key"]},
    {"name": "carol", "api_keys": ["carol-key"], "models": ["llama3*"]},
    {"name": "slow", "api_keys": ["slow-key"], "rate_limit": {"requests_per_s": 0.02}},
    {"name": "solo", "api_keys": ["solo-key"], "max_concurrent": 1, "max_queued": 0},
    {"name": "ops", "api_keys": ["ops-key"], "admin": True},
]
MAX_MESSAGES = 64
MAX_PROMPT_CHARS = 50_000
HELLO = [{"role": "user", "content": "Say hi"}]
FLOOD = 72  # count_tokens calls at once: far more than solo's one max_concurrent slot and its max_queued of 0


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, smollm2_path):
    limits = {"max_messages": MAX_MESSAGES, "max_prompt_chars": MAX_PROMPT_CHARS}
    with serving(tmp_path_factory.mktemp("admission"), smollm2_path, {"tenants": TENANTS, "limits": limits}) as d:
        yield d


def client(daemon, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=daemon.url, api_key=key, max_retries=0, timeout=120)


def call(daemon, method: str, path: str, body=None, key: str | None = None):
    return http(method, daemon.url + path, body,
                headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})})


def test_count_tokens_and_show_count_against_requests_per_s(daemon):
    slow = client(daemon, "slow-key")
    assert slow.messages.count_tokens(model=MODEL, messages=HELLO).input_tokens > 0
    with pytest.raises(anthropic.RateLimitError) as e:  # its one request a 50 s went to the first
        slow.messages.count_tokens(model=MODEL, messages=HELLO)
    assert "requests_per_s" in e.value.body["error"]["message"]
    assert int(e.value.response.headers["Retry-After"]) >= 1
    status, body, _ = call(daemon, "POST", "/api/show", {"model": MODEL}, "slow-key")
    assert status == 429 and "requests_per_s" in body["error"], body


def test_a_flood_of_count_tokens_is_held_to_max_concurrent_and_another_tenants_chat_goes_on(daemon):
    held = long_stream(daemon, "solo-key")  # solo's one slot, for as long as the test holds it
    try:
        solo = client(daemon, "solo-key")

        def count(_):
            try:
                solo.messages.count_tokens(model=MODEL, messages=HELLO)
                return "counted"
            except anthropic.RateLimitError as e:
                return e.body["error"]["message"]

        with ThreadPoolExecutor(16) as pool:
            flood = pool.map(count, range(FLOOD))
            reply = client(daemon, "alice-key").messages.create(model=MODEL, messages=HELLO, max_tokens=1,
                                                                extra_body={"temperature": 0})
            answers = list(flood)
        assert all("max_concurrent" in a for a in answers), sorted(set(answers))
        assert reply.usage.output_tokens == 1
        status, body, _ = call(daemon, "POST", "/api/show", {"model": MODEL}, "solo-key")
        assert status == 429 and "max_concurrent" in body["error"], body
    finally:
        held.close()


def test_status_shows_a_tenant_its_own_share_of_a_model_another_tenant_generates_on(daemon):
    def model_row(key: str) -> dict:
        status, body, _ = call(daemon, "GET", "/api/status", key=key)
        assert status == 200, body
        rows = [m for m in body["models"]["rows"] if m["name"] == MODEL and m["state"] == "loaded"]
        return rows[0] if rows else {}

    held = long_stream(daemon, "alice-key")
    try:
        # The operator sees alice's request running: from here to close() it runs, generating.
        assert wait_for(lambda: model_row("ops-key").get("running") == 1, timeout_s=30), model_row("ops-key")
        mine = model_row("alice-key")
        assert (mine["running"], mine["requests"]) == (1, 1) and mine["kv_blocks_used"] > 0, mine
        for _ in range(5):  # polls while it streams: none shows bob any of it
            theirs = model_row("bob-key")
            assert (theirs["running"], theirs["queued"], theirs["requests"]) == (0, 0, 0), theirs
            assert theirs["kv_blocks_used"] == 0 and theirs["kv_committed_bytes"] == 0, theirs
            assert theirs["size_bytes"] == theirs["weight_bytes"] and theirs["tokens_per_s"] is None, theirs
        assert model_row("ops-key")["running"] == 1  # it was running all along
        status, body, _ = call(daemon, "GET", "/api/status", key="carol-key")
        assert status == 200 and body["models"]["rows"] == [], body  # llama3* only: none loaded
    finally:
        held.close()


def test_only_an_admin_may_ask_whether_a_blob_is_stored(daemon):
    data = b"a blob only the operator uploaded"
    stored = "sha256:" + hashlib.sha256(data).hexdigest()
    absent = "sha256:" + hashlib.sha256(b"no such blob").hexdigest()
    assert call(daemon, "POST", f"/api/blobs/{stored}", data, "ops-key")[0] == 201
    assert call(daemon, "HEAD", f"/api/blobs/{stored}", key="ops-key")[0] == 200
    assert call(daemon, "HEAD", f"/api/blobs/{absent}", key="ops-key")[0] == 404
    for digest in (stored, absent):  # one answer for both: a tenant learns nothing of the store
        assert call(daemon, "HEAD", f"/api/blobs/{digest}", key="alice-key")[0] == 403


def calls_and_results(count: int, name: str) -> list[dict]:
    """An assistant turn of `count` tool_use blocks of tool `name`, and a user turn with each one's result."""
    uses = [{"type": "tool_use", "id": f"t{i}", "name": name, "input": {}} for i in range(count)]
    results = [{"type": "tool_result", "tool_use_id": f"t{i}", "content": "ok"} for i in range(count)]
    return [*HELLO, {"role": "assistant", "content": uses}, {"role": "user", "content": results}]


def test_each_tool_result_block_counts_as_a_message(daemon):
    alice = client(daemon, "alice-key")
    with pytest.raises(anthropic.BadRequestError) as e:  # 3 messages as sent; 2,050 as rendered
        alice.messages.count_tokens(model=MODEL, messages=calls_and_results(2048, "f"))
    message = e.value.body["error"]["message"]
    assert f"more than the limit of {MAX_MESSAGES} (limits.max_messages)" in message, message
    assert alice.messages.count_tokens(model=MODEL, messages=calls_and_results(8, "f")).input_tokens > 0


def test_history_tool_use_names_count_under_max_prompt_chars(daemon):
    alice = client(daemon, "alice-key")
    with pytest.raises(anthropic.BadRequestError) as e:
        alice.messages.count_tokens(model=MODEL, messages=calls_and_results(1, "x" * (MAX_PROMPT_CHARS + 1)))
    message = e.value.body["error"]["message"]
    assert f"more than the limit of {MAX_PROMPT_CHARS} (limits.max_prompt_chars)" in message, message
