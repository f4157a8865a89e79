"""/metrics, /health and /ready of a live daemon (real SmolLM2, loopback port) after real
traffic, read the way Prometheus reads them: prometheus-client's own text parser."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon_fixture import MODEL, Daemon, http, long_stream, serving, wait_for
from gpushare.node.gpu import read_gpus

KEY = "alice-metrics-key"
ADMIN_KEY = "ops-metrics-key"  # a Prometheus scraper's: /metrics names every tenant
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 4,
        "temperature": 0}


def call(daemon: Daemon, method: str, path: str, body=None, key: str | None = KEY):
    """(status, parsed JSON or text, headers), with tenant alice's key unless told otherwise."""
    return http(method, daemon.url + path, body, headers={"Authorization": f"Bearer {key}"} if key else {})


def scrape(daemon: Daemon) -> dict[tuple, float]:
    """{(sample name, sorted labels...): value} of one /metrics scrape."""
    status, text, headers = call(daemon, "GET", "/metrics", key=ADMIN_KEY)
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    return {(s.name, *sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float | None:
    return samples.get((name, *sorted(labels.items())))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, smollm2_path):
    with serving(tmp_path_factory.mktemp("metrics"), smollm2_path,
                 {"tenants": [{"name": "alice", "api_keys": [KEY]},
                              {"name": "ops", "api_keys": [ADMIN_KEY], "admin": True}]}) as d:
        yield d


def test_health_and_ready_answer_json_without_a_key(daemon):
    assert call(daemon, "GET", "/health", key=None)[0] == 200
    status, body, _ = call(daemon, "GET", "/ready", key=None)
    assert status == 200 and body == {"status": "serving"}


def test_metrics_need_an_admin_key(daemon):
    status, body, headers = call(daemon, "GET", "/metrics", key=None)
    assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer") and "missing API key" in body["error"]
    status, body, _ = call(daemon, "GET", "/metrics", key=KEY)
    assert status == 403 and 'tenant "alice" may not read /metrics' in body["error"]


def test_gauges_show_a_stream_in_flight(daemon):
    conn = long_stream(daemon, KEY)  # cannot end on its own before the scrape
    m = scrape(daemon)
    conn.close()  # the client leaves mid-stream: counted as cancelled below
    assert value(m, "gpushare_running_sequences", model=MODEL) + value(m, "gpushare_queue_depth", model=MODEL) == 1
    assert value(m, "gpushare_kv_blocks_used", model=MODEL) >= 1
    assert value(m, "gpushare_tenant_kv_used_bytes", tenant="alice") > 0
    assert value(m, "gpushare_http_requests_in_flight") == 1
    assert wait_for(lambda: value(scrape(daemon), "gpushare_requests_total", model=MODEL, tenant="alice",
                                  outcome="cancelled") == 1, 10)


def test_counters_and_histograms_after_traffic(daemon):
    before = scrape(daemon)
    prompt = generated = 0
    for _ in range(2):  # the same conversation twice: the second reuses the first one's prefix blocks
        status, reply, _ = call(daemon, "POST", "/v1/chat/completions", CHAT)
        assert status == 200
        usage = reply["usage"]
        prompt += usage["prompt_tokens"]
        generated += usage["completion_tokens"]
    status, reply, _ = call(daemon, "POST", "/api/generate", {"model": MODEL, "prompt": "Hi", "stream": False,
                                                              "options": {"num_predict": 3, "temperature": 0}})
    assert status == 200
    prompt += reply["prompt_eval_count"]
    generated += reply["eval_count"]
    assert call(daemon, "POST", "/api/generate", {"model": "no-such-model", "prompt": "Hi"})[0] == 404
    assert call(daemon, "POST", "/api/generate", {"model": MODEL, "prompt": "Hi"}, key="wrong")[0] == 401
    m = scrape(daemon)

    def delta(name, **labels):
        return value(m, name, **labels) - (value(before, name, **labels) or 0)

    alice = {"model": MODEL, "tenant": "alice"}
    assert delta("gpushare_requests_total", **alice, outcome="ok") == 3
    assert value(m, "gpushare_requests_total", model="", tenant="alice", outcome="invalid") == 1  # unknown model
    # A bad key is refused before its body is read: counted, but not worth parsing up to 64 MiB for a label.
    assert value(m, "gpushare_requests_total", model="", tenant="", outcome="invalid") == 1
    assert delta("gpushare_prompt_tokens_total", **alice) == prompt
    assert delta("gpushare_generated_tokens_total", **alice) == generated
    assert delta("gpushare_prefix_cache_hit_tokens_total", **alice) >= 16  # at least one full block reused
    assert delta("gpushare_time_to_first_token_seconds_count", **alice) == 3
    assert delta("gpushare_time_to_first_token_seconds_sum", **alice) > 0
    assert delta("gpushare_inter_token_latency_seconds_count", **alice) == generated - 3
    assert value(m, "gpushare_time_to_first_token_seconds_bucket", **alice, le="+Inf") == \
        value(m, "gpushare_time_to_first_token_seconds_count", **alice)
    # End to end and queue time, each request once: its queue ends before its first token, which
    # comes before its end.
    assert delta("gpushare_request_duration_seconds_count", **alice) == 3
    assert delta("gpushare_request_queue_time_seconds_count", **alice) == 3
    queue_s = delta("gpushare_request_queue_time_seconds_sum", **alice)
    ttft_s = delta("gpushare_time_to_first_token_seconds_sum", **alice)
    assert 0 < queue_s <= ttft_s < delta("gpushare_request_duration_seconds_sum", **alice)

    # Idle again: every block free (cached prefix blocks count as free), nothing queued or running.
    total = value(m, "gpushare_kv_blocks_total", model=MODEL)
    assert total > 0 and value(m, "gpushare_kv_blocks_used", model=MODEL) == 0
    assert value(m, "gpushare_kv_blocks_free", model=MODEL) == total
    assert value(m, "gpushare_kv_blocks_cached", model=MODEL) >= 1
    assert value(m, "gpushare_running_sequences", model=MODEL) == 0
    assert value(m, "gpushare_queue_depth", model=MODEL) == 0
    assert value(m, "gpushare_preemptions_total", model=MODEL) == 0
    assert value(m, "gpushare_models_loaded") == 1
    assert value(m, "gpushare_model_loads_total", model=MODEL) == 1
    assert value(m, "gpushare_model_load_duration_seconds_count", model=MODEL) == 1
    assert value(m, "gpushare_model_load_duration_seconds_sum", model=MODEL) > 0
    assert 0 <= value(m, "gpushare_engine_last_tick_age_seconds") < 5
    gpus = read_gpus()
    assert (value(m, "gpushare_gpu_memory_total_bytes", gpu="0", uuid=gpus.gpus[0].uuid) > 0) if gpus.available \
        else not any(key[0].startswith("gpushare_gpu_") for key in m)


def test_unloading_a_model_is_counted(daemon):
    status, _, _ = call(daemon, "POST", "/api/generate", {"model": MODEL, "keep_alive": 0}, key=ADMIN_KEY)
    assert status == 200
    assert wait_for(lambda: value(scrape(daemon), "gpushare_model_unloads_total", model=MODEL) == 1, 10)
    assert value(scrape(daemon), "gpushare_models_loaded") == 0
