"""Tenants stay apart (docs/security.md), on a live daemon with tenants and, at first,
server.trust_gateway_headers on (the last test reloads with it off and checks the same):

- a fairness-id header picks a fair-share group inside the key's tenant, never another tenant's KV
  limit or prefix-cache scope;
- /api/ps shows a tenant its own running, queued and KV use of a model others use too;
- a model's load error names its file, never where the node keeps it, and one broken model does not
  fail /v1/models;
- an empty-prompt generate and /api/load count against requests_per_s and max_concurrent.
"""

from __future__ import annotations

import json
import signal

import pytest
from daemon_fixture import MODEL, http, long_stream, serving, wait_for, write_config

FAIRNESS = "x-gateway-inference-fairness-id"
TENANTS = [
    {"name": "alice", "api_keys": ["alice-key"]},
    {"name": "bob", "api_keys": ["bob-key"]},
    {"name": "tiny", "api_keys": ["tiny-key"], "kv_limit": "32tok"},
    {"name": "slow", "api_keys": ["slow-key"], "rate_limit": {"requests_per_s": 0.02}},
    {"name": "slower", "api_keys": ["slower-key"], "rate_limit": {"requests_per_s": 0.02}},
    {"name": "solo", "api_keys": ["solo-key"], "max_concurrent": 1, "max_queued": 0},
    {"name": "ops", "api_keys": ["ops-key"], "admin": True},
]
# A prompt of about 60 tokens: more than tiny's kv_limit, several KV blocks of 16 for the prefix cache.
LONG = "The river runs to the sea, and the sea is never full; to the place the rivers come from, " * 3


def config(trusted: bool) -> dict:
    return {"tenants": TENANTS, "server": {"trust_gateway_headers": trusted}}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, smollm2_path):
    with serving(tmp_path_factory.mktemp("sectenants"), smollm2_path, config(True)) as d:
        yield d


def call(daemon, method: str, path: str, body=None, key: str | None = None, headers: dict | None = None):
    return http(method, daemon.url + path, body,
                headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}),
                         **(headers or {})})


def generate(daemon, key: str, prompt: str, headers: dict | None = None):
    body = {"model": MODEL, "prompt": prompt, "raw": True, "stream": False,
            "options": {"temperature": 0, "num_predict": 1}}
    return call(daemon, "POST", "/api/generate", body, key, headers)


def tenant_row(daemon, key: str) -> dict:
    (row,) = call(daemon, "GET", "/api/ps", key=key)[1]["tenants"]
    return row


def check_headers_stay_inside_the_tenant(daemon) -> None:
    # another tenant's kv_limit: a header can neither put a request under it nor take one out of it
    status, body, _ = generate(daemon, "alice-key", LONG, {FAIRNESS: "tiny"})
    assert status == 200, body
    status, body, _ = generate(daemon, "tiny-key", LONG, {FAIRNESS: "alice"})
    assert status == 400 and "kv_limit (32 tokens)" in body["error"], body
    # another tenant's prefix cache: alice's blocks are no hit for bob, whatever his header says
    prompt = f"[{daemon.log().count('config reloaded')}] {LONG}"  # new blocks for each run
    generate(daemon, "alice-key", prompt)
    assert generate(daemon, "alice-key", prompt)[0] == 200
    alice_hits, bob_hits = tenant_row(daemon, "alice-key")["prefix_hit_tokens"], \
        tenant_row(daemon, "bob-key")["prefix_hit_tokens"]
    assert alice_hits >= 32  # her own second request reused her blocks
    assert generate(daemon, "bob-key", prompt, {FAIRNESS: "alice"})[0] == 200
    assert tenant_row(daemon, "bob-key")["prefix_hit_tokens"] == bob_hits
    assert tenant_row(daemon, "alice-key")["prefix_hit_tokens"] == alice_hits


def test_a_fairness_header_cannot_reach_another_tenants_limits_or_cache(daemon):
    check_headers_stay_inside_the_tenant(daemon)


def test_ps_shows_a_tenant_its_own_share_of_a_shared_model(daemon):
    held = long_stream(daemon, "alice-key")
    try:
        def row(key):
            (model,) = [m for m in call(daemon, "GET", "/api/ps", key=key)[1]["models"] if m["name"] == MODEL]
            return model

        mine = wait_for(lambda: (r := row("alice-key"))["running"] == 1 and r, timeout_s=30)
        assert mine and mine["kv_blocks_used"] > 0 and mine["kv_committed_bytes"] > 0 and mine["requests"] == 1
        theirs = row("bob-key")
        assert (theirs["running"], theirs["queued"], theirs["requests"]) == (0, 0, 0)
        assert theirs["kv_blocks_used"] == 0 and theirs["kv_committed_bytes"] == 0
        assert theirs["size"] == theirs["weight_bytes"]
        assert row("ops-key")["running"] >= 1  # the operator sees everyone's
    finally:
        held.close()


def test_a_load_error_names_the_file_not_the_nodes_path_and_v1_models_still_lists(daemon, tmp_path, smollm2_path):
    hidden = tmp_path / "where-the-node-keeps-models"
    hidden.mkdir()
    cut = hidden / "cut.gguf"
    with open(smollm2_path, "rb") as f:
        cut.write_bytes(f.read(4096))  # the magic and a header cut short
    status, body, _ = call(daemon, "POST", "/api/create", {"model": "broken", "from": str(cut)}, "ops-key")
    assert status == 200, body
    body = {"model": "broken", "prompt": "hi", "stream": False}
    status, body, _ = call(daemon, "POST", "/api/generate", body, "alice-key")
    assert status == 422 and "corrupt or truncated GGUF file" in body["error"], body
    text = json.dumps(body)
    assert str(tmp_path) not in text and str(daemon.models_dir) not in text
    status, listing, _ = call(daemon, "GET", "/v1/models", key="alice-key")
    assert status == 200, listing
    by_id = {m["id"]: m for m in listing["data"]}
    assert by_id[MODEL]["max_model_len"] == 8192 and "max_model_len" not in by_id["broken"]
    call(daemon, "DELETE", "/api/delete", {"model": "broken"}, "ops-key")


def test_an_empty_prompt_generate_and_api_load_count_against_the_limits(daemon):
    load = {"model": MODEL}
    assert call(daemon, "POST", "/api/generate", load, "slow-key")[0] == 200  # loads, takes the one token
    for path in ("/api/generate", "/api/load"):
        status, body, headers = call(daemon, "POST", path, load, "slow-key")
        assert status == 429 and "requests_per_s" in body["error"] and int(headers["Retry-After"]) >= 1, (path, body)
    assert call(daemon, "POST", "/api/load", load, "slower-key")[0] == 200
    status, body, _ = call(daemon, "POST", "/api/generate", load, "slower-key")
    assert status == 429 and "requests_per_s" in body["error"]
    held = long_stream(daemon, "solo-key")
    try:
        for path in ("/api/generate", "/api/load"):
            status, body, _ = call(daemon, "POST", path, load, "solo-key")
            assert status == 429 and "max_concurrent" in body["error"], (path, body)
    finally:
        held.close()


def test_with_the_option_off_headers_stay_inside_the_tenant_too(daemon, smollm2_path):
    port = int(daemon.host.split(":")[1])
    reloads = daemon.log().count("config reloaded")
    write_config(daemon.models_dir.parent, port, smollm2_path, config(False))
    daemon.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: daemon.log().count("config reloaded") > reloads, timeout_s=30), daemon.log()
    check_headers_stay_inside_the_tenant(daemon)

