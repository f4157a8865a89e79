"""gpushare behind a Gateway API Inference Extension gateway, on a live daemon (real SmolLM2, loopback
port): the vllm:* gauges its endpoint picker scrapes, read with prometheus-client's own text parser
while requests run and queue, and the trusted fairness and objective headers; and the engine side of
an objective: a request's own priority."""

from __future__ import annotations

import signal
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon_fixture import MODEL, Daemon, http, long_stream, serving, wait_for, write_config
from gpushare.settings.settings import ConfigError, parse_settings
from gpushare.protocol.tenant_policy import TenantPolicy
from test_engine import chat_ids, greedy, small_engine

CHAT_KEY, BATCH_KEY, OPS_KEY = "chat-gw-key", "batch-gw-key", "ops-gw-key"
TENANTS = [{"name": "chat", "api_keys": [CHAT_KEY]},
           {"name": "batch", "api_keys": [BATCH_KEY], "priority": "batch"},
           {"name": "ops", "api_keys": [OPS_KEY], "admin": True}]
GATEWAY = {"server": {"trust_gateway_headers": True, "open_gateway_metrics": True},
           "engine": {"max_num_seqs": 1},  # one request runs, the next ones wait in the engine
           "tenants": TENANTS}
FAIRNESS, OBJECTIVE = "x-gateway-inference-fairness-id", "x-gateway-inference-objective"
OTHER = "other:135m"  # the same file under a second name: a second model with its own pool and gauges


def gateway_config(smollm2_path: str, **server) -> dict:
    models = [{"name": name, "path": smollm2_path, "preload": True} for name in (MODEL, OTHER)]
    return {**GATEWAY, "models": models, "server": {**GATEWAY["server"], **server}}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, smollm2_path):
    with serving(tmp_path_factory.mktemp("gateway"), smollm2_path, gateway_config(smollm2_path)) as d:
        yield d


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def gateway_scrape(daemon: Daemon) -> dict:
    """The families of /metrics/gateway, asked as the endpoint picker asks: with no key."""
    status, text, headers = http("GET", daemon.url + "/metrics/gateway")
    assert status == 200 and headers["Content-Type"].startswith("text/plain"), text
    return families(text)


def gauge(fams: dict, name: str) -> dict[str, float]:
    """{model_name: value} of one vllm:* gauge."""
    return {s.labels["model_name"]: s.value for s in fams[name].samples}


def requests_by_tenant(daemon: Daemon) -> dict[str, float]:
    """Finished requests per tenant label, from /metrics read with the admin key."""
    status, text, _ = http("GET", daemon.url + "/metrics", headers={"Authorization": f"Bearer {OPS_KEY}"})
    assert status == 200
    totals: dict[str, float] = {}
    for s in families(text)["gpushare_requests"].samples:
        if s.name == "gpushare_requests_total":
            totals[s.labels["tenant"]] = totals.get(s.labels["tenant"], 0) + s.value
    return totals


def complete(daemon: Daemon, key: str, headers: dict | None = None) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    status, reply, _ = http("POST", daemon.url + "/v1/completions", body,
                            headers={"Authorization": f"Bearer {key}", **(headers or {})})
    assert status == 200, reply


def test_the_vllm_gauges_exist_per_model_and_move_while_requests_queue(daemon):
    idle = gateway_scrape(daemon)
    assert gauge(idle, "vllm:num_requests_waiting") == {MODEL: 0, OTHER: 0}
    assert gauge(idle, "vllm:num_requests_running") == {MODEL: 0, OTHER: 0}
    assert gauge(idle, "vllm:kv_cache_usage_perc") == {MODEL: 0, OTHER: 0}
    infos = {s.labels["model_name"]: s for s in idle["vllm:cache_config_info"].samples}
    assert set(infos) == {MODEL, OTHER}
    info = infos[MODEL]
    assert info.value == 1 and info.labels["block_size"] == "16" and int(info.labels["num_gpu_blocks"]) > 0

    running = long_stream(daemon, CHAT_KEY)  # holds the one place in the batch
    queued = [long_stream(daemon, CHAT_KEY, wait_for_first_token=False) for _ in range(2)]
    try:
        busy = wait_for(lambda: (m := gateway_scrape(daemon)) and
                        gauge(m, "vllm:num_requests_waiting")[MODEL] == 2 and m, timeout_s=60)
        assert busy, "the two queued requests never showed as waiting"
        assert gauge(busy, "vllm:num_requests_waiting")[OTHER] == 0  # each model's own queue
        assert gauge(busy, "vllm:num_requests_running") == {MODEL: 1, OTHER: 0}
        usage = gauge(busy, "vllm:kv_cache_usage_perc")
        assert 0 < usage[MODEL] <= 1 and usage[OTHER] == 0
        # /metrics carries them too, beside our names: the fraction is the blocks held over the pool
        # the info gauge names (within the one block the running stream may take between two reads).
        status, text, _ = http("GET", daemon.url + "/metrics", headers={"Authorization": f"Bearer {OPS_KEY}"})
        fams = families(text)
        used = {s.labels["model"]: s.value for s in fams["gpushare_kv_blocks_used"].samples}
        total = int(info.labels["num_gpu_blocks"])
        assert abs(gauge(fams, "vllm:kv_cache_usage_perc")[MODEL] * total - used[MODEL]) <= 1
    finally:
        for conn in [running, *queued]:
            conn.close()
    assert wait_for(lambda: gauge(m := gateway_scrape(daemon), "vllm:num_requests_waiting")[MODEL] == 0 and
                    gauge(m, "vllm:num_requests_running")[MODEL] == 0 and
                    gauge(m, "vllm:kv_cache_usage_perc")[MODEL] == 0, timeout_s=30)


def test_only_the_gateway_gauges_are_open(daemon):
    text = http("GET", daemon.url + "/metrics/gateway")[1]
    assert "tenant" not in text and "gpushare_" not in text  # no tenant's traffic without a key
    status, body, _ = http("GET", daemon.url + "/metrics")
    assert status == 401 and "missing API key" in body["error"]


def test_a_trusted_fairness_id_picks_the_tenant_queue(daemon):
    before = requests_by_tenant(daemon)
    complete(daemon, CHAT_KEY, {FAIRNESS: "batch", OBJECTIVE: "interactive"})
    after = requests_by_tenant(daemon)
    assert after.get("batch", 0) == before.get("batch", 0) + 1
    assert after.get("chat", 0) == before.get("chat", 0)


def test_an_unknown_fairness_id_falls_back_to_the_keys_tenant_logged_once(daemon):
    before = requests_by_tenant(daemon)
    for _ in range(2):
        complete(daemon, BATCH_KEY, {FAIRNESS: "nobody-here", OBJECTIVE: "urgent"})
    after = requests_by_tenant(daemon)
    assert after["batch"] == before["batch"] + 2
    log = daemon.log()
    assert log.count("x-gateway-inference-fairness-id 'nobody-here' names no tenant") == 1
    assert 'the key\'s tenant "batch"' in log
    assert log.count("x-gateway-inference-objective 'urgent' names no priority") == 1


def test_untrusted_headers_are_ignored(daemon, tmp_path_factory, smollm2_path):
    """server.trust_gateway_headers off (the default; live on reload): a caller cannot pick another
    tenant's share, nor a closed /metrics/gateway be read without a key."""
    port = int(daemon.host.split(":")[1])
    reloads = daemon.log().count("config reloaded")
    write_config(daemon.models_dir.parent, port, smollm2_path,
                 gateway_config(smollm2_path, trust_gateway_headers=False, open_gateway_metrics=False))
    daemon.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: daemon.log().count("config reloaded") > reloads, timeout_s=30), daemon.log()
    before = requests_by_tenant(daemon)
    complete(daemon, CHAT_KEY, {FAIRNESS: "batch", OBJECTIVE: "batch"})
    after = requests_by_tenant(daemon)
    assert after["chat"] == before["chat"] + 1 and after.get("batch") == before.get("batch")
    assert http("GET", daemon.url + "/metrics/gateway")[0] == 401
    status, text, _ = http("GET", daemon.url + "/metrics/gateway", headers={"Authorization": f"Bearer {OPS_KEY}"})
    assert status == 200 and "vllm:kv_cache_usage_perc" in text


def first_token_order(llm, priority_of_a: str | None) -> list[str]:
    """Tenants a then b (both interactive) each submit one prompt to an engine that runs one sequence
    at a time, a first; which one's tokens come first. `priority_of_a`: a's request's own priority."""
    engine = small_engine(llm, 64, max_num_seqs=1)
    engine.set_tenants([TenantPolicy("a"), TenantPolicy("b")])
    order: list[str] = []
    finished = threading.Semaphore(0)

    def submit(tenant: str, priority: str | None) -> None:
        def on_output(out):
            if out.token_ids and tenant not in order:
                order.append(tenant)
            if out.finished:
                finished.release()

        engine.submit(engine.request("m", chat_ids(llm, "Hi"), greedy(2), tenant=tenant, priority=priority), on_output)

    submit("a", priority_of_a)
    submit("b", None)
    engine.start()  # its first turn takes both in before it schedules
    try:
        assert finished.acquire(timeout=120) and finished.acquire(timeout=120)
    finally:
        engine.shutdown()
    return order


def test_an_objective_priority_overrides_the_tenants_in_the_engine(llm):
    assert first_token_order(llm, None) == ["a", "b"]  # same priority: first come, first served
    assert first_token_order(llm, "batch") == ["b", "a"]  # a's request asked for batch: b goes first


def test_an_unknown_priority_is_refused_at_submit(llm):
    engine = small_engine(llm, 64)
    with pytest.raises(ValueError, match="priority must be one of interactive, batch, got 'urgent'"):
        engine.submit(engine.request("m", chat_ids(llm, "Hi"), greedy(2), tenant="a", priority="urgent"), lambda out: None)


@pytest.mark.parametrize("key", ["trust_gateway_headers", "open_gateway_metrics"])
def test_the_switches_are_booleans_named_in_errors(key):
    assert getattr(parse_settings(None, env={}).server, key) is False  # off unless asked for
    with pytest.raises(ConfigError, match=f"server.{key}: must be true or false, got 'yes'"):
        parse_settings({"server": {key: "yes"}}, env={})
