"""Config parsing: defaults, environment overrides, and errors that name the key."""

from pathlib import Path

import pytest
import yaml

from gpushare.settings.settings import (BUNDLED_MODEL_NAME, ConfigError, load_settings, parse_duration_s, parse_host,
                             parse_settings, parse_size_bytes)

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_defaults_serve_the_bundled_model_on_ollamas_port(smollm2_path):
    s = parse_settings(None, env={})
    assert s.server.host == "127.0.0.1:11434" and s.server.keep_alive_s == 300
    assert [(m.name, m.path) for m in s.models] == [(BUNDLED_MODEL_NAME, smollm2_path)]
    assert s.models_dir == Path("~/.local/share/gpushare/models").expanduser()
    assert (s.engine.max_num_seqs, s.engine.block_size, s.memory.kv_budget_bytes) == (64, 16, 2 << 30)


def test_environment_overrides_the_file():
    env = {"GPUSHARE_HOST": "0.0.0.0:9999", "GPUSHARE_MODELS": "/srv/models", "GPUSHARE_KEEP_ALIVE": "-1"}
    s = parse_settings({"server": {"host": "127.0.0.1:1", "keep_alive": "1m"}, "models_dir": "/x"}, env=env)
    assert (s.server.host, str(s.models_dir), s.server.keep_alive_s) == ("0.0.0.0:9999", "/srv/models", -1.0)


def test_a_file_with_relative_model_paths_and_host_flag(tmp_path, monkeypatch):
    monkeypatch.delenv("GPUSHARE_HOST", raising=False)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"models": [{"name": "m", "path": "m.gguf", "keep_alive": "10m",
                                               "preload": True}]}))
    s = load_settings(cfg, host=":8080")
    assert s.models[0].path == str(tmp_path / "m.gguf") and s.models[0].keep_alive_s == 600
    assert s.models[0].preload and parse_host(s.server.host) == ("127.0.0.1", 8080)


@pytest.mark.parametrize("name", ["reference.yaml", "workstation.yaml", "multi-tenant.yaml"])
def test_example_configs_are_valid(name):
    s = load_settings(CONFIGS / name)
    assert s.server.host


@pytest.mark.parametrize("raw, message", [
    ({"engine": {"max_num_seqs": -1}}, "engine.max_num_seqs: must be a positive integer, got -1"),
    ({"engine": {"block_size": "16"}}, "engine.block_size: must be a positive integer, got '16'"),
    ({"engine": {"dtype": "fp8"}}, "engine.dtype: must be one of auto, float32, float16, bfloat16, got 'fp8'"),
    ({"engine": {"max_seqs": 4}}, "engine.max_seqs: unknown key"),
    ({"engine": {"kv_dtype": "int3"}}, "engine.kv_dtype: must be one of auto, float32, bfloat16, float16, int8, got 'int3'"),
    ({"engine": {"device": "cuda", "kv_dtype": "int8"}}, "engine.kv_dtype: int8 runs on the CPU only"),
    ({"engine": {"device": "cpu", "kv_dtype": "float16"}}, "engine.kv_dtype: float16 is for GPUs"),
    ({"server": {"host": "localhost:99999"}}, "server.host: must be HOST:PORT with a port in 1..65535"),
    ({"server": {"drain_timeout": "soon"}}, "server.drain_timeout: must be a duration like 30s"),
    ({"server": {"max_queued": -3}}, "server.max_queued: must be a non-negative integer, got -3"),
    ({"server": "yes"}, "server: must be a mapping"),
    ({"memory": {"kv_budget": "lots"}}, "memory.kv_budget: must be a size like 512MiB"),
    ({"memory": {"budget": "1GiB", "kv_budget": "2GiB"}}, "memory.budget: must be at least memory.kv_budget"),
    ({"models": {"name": "x"}}, "models: must be a list"),
    ({"models": [{"name": "x"}]}, "models[0].path: required"),
    ({"models": [{"name": "x", "path": "/no/such.gguf"}]}, "models[0].path: no such file or folder"),
    ({"models": [{"name": "x", "path": "/", "keep_alive": "forever"}]}, "models[0].keep_alive: must be a duration"),
    ({"models": [{"name": "x", "path": "/"}, {"name": "x", "path": "/"}]}, "models[1].name: duplicate model name"),
    ({"models": [{"name": "x", "adapter": "/no/such-lora", "base": "b"}]}, "models[0].adapter: no such file or folder"),
    ({"models": [{"name": "x", "adapter": "/"}]}, "models[0].base: required with models[0].adapter"),
    ({"models": [{"name": "x", "adapter": "/", "base": "b", "path": "/"}]}, "models[0].path: an adapter entry runs on"),
    ({"models": [{"name": "x", "adapter": "/", "base": "b", "replicas": 2}]}, "models[0].replicas: an adapter runs"),
    ({"models": [{"name": "x", "path": "/", "base": "b"}]}, "models[0].base: only an adapter entry"),
    ({"node": {"manage": "yes please"}}, "node.manage"),
    ({"servers": {}}, "servers: unknown key"),
])
def test_errors_name_the_key_and_the_problem(raw, message):
    with pytest.raises(ConfigError) as info:
        parse_settings(raw, env={})
    assert message in str(info.value)


def test_unreadable_or_invalid_yaml_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_settings(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("server: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_settings(bad)


def test_bad_environment_values_name_the_variable():
    with pytest.raises(ConfigError, match="GPUSHARE_KEEP_ALIVE: must be a duration"):
        parse_settings(None, env={"GPUSHARE_KEEP_ALIVE": "a while"})
    with pytest.raises(ConfigError, match="GPUSHARE_HOST: must be HOST:PORT"):
        parse_settings(None, env={"GPUSHARE_HOST": "host:port"})


def test_durations_sizes_and_hosts():
    assert [parse_duration_s(v) for v in (30, "500ms", "5m", "1h30m", "-1", "-1m", "0")] == \
        [30, 0.5, 300, 5400, -1, -60, 0]
    assert [parse_size_bytes(v) for v in (1024, "512MiB", "8GiB", "2GB")] == [1024, 512 << 20, 8 << 30, 2 * 10**9]
    assert parse_host("0.0.0.0") == ("0.0.0.0", 11434)
    assert parse_host("http://[::1]:8000/") == ("::1", 8000)


def test_tenants_map_keys_to_digests_and_amounts_to_bytes_or_tokens():
    import hashlib

    digest = hashlib.sha256(b"s3cret").hexdigest()
    s = parse_settings({"prefix_cache": {"scope": "global"}, "tenants": [
        {"name": "a", "api_keys": ["s3cret"], "kv_reserved": "512MiB", "kv_limit": "8192tok", "max_concurrent": 2,
         "max_queued": 5, "rate_limit": {"requests_per_s": 0.5, "tokens_per_min": 20000}, "weight": 2,
         "priority": "batch", "models": ["smollm2:*"]},
        {"name": "b", "api_keys": [f"sha256:{'AB' * 32}"]}]}, env={})
    a, b = s.tenants
    assert (a.api_key_sha256, b.api_key_sha256, s.prefix_cache_scope) == ([digest], ["ab" * 32], "global")
    assert (a.kv_reserved_bytes, a.kv_reserved_tokens, a.kv_limit_bytes, a.kv_limit_tokens) == \
        (512 << 20, 0, None, 8192)
    assert (a.max_concurrent, a.max_queued, a.requests_per_s, a.tokens_per_min) == (2, 5, 0.5, 20000)
    assert (a.weight, a.priority, a.models, b.models, b.priority) == (2.0, "batch", ["smollm2:*"], None, "interactive")


@pytest.mark.parametrize("tenant, message", [
    ({"api_keys": ["k"]}, "tenants[0].name: required"),
    ({"name": "a b", "api_keys": ["k"]}, "tenants[0].name: required, 1-64 letters"),
    ({"name": "a"}, "tenants[0].api_keys: required"),
    ({"name": "a", "api_keys": ["sha256:abc"]}, "tenants[0].api_keys[0]: sha256: must be followed by 64 hex"),
    ({"name": "a", "api_keys": ["k"], "kv_limit": "lots"}, "tenants[0].kv_limit: must be a size like 512MiB or a "
                                                            "token count like 8192tok"),
    ({"name": "a", "api_keys": ["k"], "kv_reserved": "2GiB", "kv_limit": "1GiB"},
     "tenants[0].kv_reserved: must not exceed tenants[0].kv_limit"),
    ({"name": "a", "api_keys": ["k"], "max_concurrent": 0}, "tenants[0].max_concurrent: must be a positive integer"),
    ({"name": "a", "api_keys": ["k"], "max_queued": 3}, "tenants[0].max_queued: needs tenants[0].max_concurrent"),
    ({"name": "a", "api_keys": ["k"], "rate_limit": {"requests_per_s": -1}},
     "tenants[0].rate_limit.requests_per_s: must be a positive number"),
    ({"name": "a", "api_keys": ["k"], "rate_limit": {"rpm": 3}}, "tenants[0].rate_limit.rpm: unknown key"),
    ({"name": "a", "api_keys": ["k"], "weight": 0}, "tenants[0].weight: must be a positive number"),
    ({"name": "a", "api_keys": ["k"], "priority": "urgent"}, "tenants[0].priority: must be one of interactive, batch"),
    ({"name": "a", "api_keys": ["k"], "models": "llama"}, "tenants[0].models: must be a list"),
    ({"name": "a", "api_keys": ["k"], "quota": 1}, "tenants[0].quota: unknown key"),
])
def test_tenant_errors_name_the_key(tenant, message):
    with pytest.raises(ConfigError) as info:
        parse_settings({"tenants": [tenant]}, env={})
    assert message in str(info.value)


def test_tenant_names_and_keys_are_unique_and_reservations_fit_the_kv_budget():
    with pytest.raises(ConfigError, match=r"tenants\[1\].name: duplicate tenant name 'a'"):
        parse_settings({"tenants": [{"name": "a", "api_keys": ["k1"]}, {"name": "a", "api_keys": ["k2"]}]}, env={})
    with pytest.raises(ConfigError, match=r"tenants\[1\].api_keys: a key of tenant 'b' is also a key of tenant 'a'"):
        parse_settings({"tenants": [{"name": "a", "api_keys": ["k"]}, {"name": "b", "api_keys": ["k"]}]}, env={})
    with pytest.raises(ConfigError, match=r"tenants: kv_reserved adds up to 1342177280 bytes, more than the KV "
                                          r"pool \(memory.kv_budget = 1073741824 bytes\)"):
        parse_settings({"memory": {"kv_budget": "1GiB"}, "tenants": [
            {"name": "a", "api_keys": ["k1"], "kv_reserved": "768MiB"},
            {"name": "b", "api_keys": ["k2"], "kv_reserved": "512MiB"}]}, env={})
    with pytest.raises(ConfigError, match="prefix_cache.scope: must be one of tenant, global, off"):
        parse_settings({"prefix_cache": {"scope": "everyone"}}, env={})


SECRET_KEY = "sk-live-4f9a1c2e8b7d6a5f"


@pytest.mark.parametrize("document", [
    f"- name: chat\n  api_keys: [{SECRET_KEY}]\n",  # a top-level list: once echoed whole
    f"{SECRET_KEY}\n",  # a bare string
    f"server: [{SECRET_KEY}]\n",
    f"models: {{name: x, key: {SECRET_KEY}}}\n",
    f"engine:\n  devices: {{a: {SECRET_KEY}}}\n",
    f"tenants:\n  - name: a\n    api_keys: [*{SECRET_KEY}]\n",  # an alias the parser quotes
    f"tenants:\n  - name: a\n    api_keys: [{SECRET_KEY}]\n  - {SECRET_KEY}\n",
])
def test_config_errors_never_quote_the_document(tmp_path, document):
    path = tmp_path / "gpushare.yaml"
    path.write_text(document)
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert SECRET_KEY not in str(info.value) and "sk-live" not in str(info.value)


def test_the_published_placeholder_keys_are_refused():
    from gpushare.settings.tenant_settings import PLACEHOLDER_KEYS, hash_api_key

    for key in PLACEHOLDER_KEYS:
        for form in (key, f"sha256:{hash_api_key(key)}"):
            with pytest.raises(ConfigError, match=r"tenants\[0\].api_keys\[0\]: this is a published placeholder key") \
                    as info:
                parse_settings({"tenants": [{"name": "t", "api_keys": [form]}]}, env={})
            assert key not in str(info.value)


def test_the_daemon_refuses_to_start_with_a_placeholder_key(tmp_path):
    """`gpushare serve` exits at once with the config error on stderr (no model is loaded first)."""
    import subprocess
    import sys
    from pathlib import Path

    config = tmp_path / "gpushare.yaml"
    config.write_text("server: {host: 127.0.0.1:1}\nmodels: []\n"
                      "tenants:\n  - name: ops\n    api_keys: [gpushare-ops-change-me]\n    admin: true\n")
    done = subprocess.run([str(Path(sys.executable).parent / "gpushare"), "serve", "--config", str(config)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "tenants[0].api_keys[0]: this is a published placeholder key" in done.stdout + done.stderr


def test_the_device_margin_is_a_size_and_a_reload_keeps_the_one_the_daemon_started_with():
    from gpushare.daemon.lifecycle import keep_start_only_settings

    old = parse_settings({"memory": {"device_margin": "1GiB"}}, env={})
    new = parse_settings({"memory": {"device_margin": "3GiB", "kv_budget": "1GiB"}}, env={})
    assert (old.memory.device_margin_bytes, new.memory.device_margin_bytes) == (1 << 30, 3 << 30)
    assert keep_start_only_settings(old, new) == ["memory.kv_budget", "memory.device_margin"]
    assert (new.memory.device_margin_bytes, new.memory.kv_budget_bytes) == (1 << 30, 2 << 30)
    with pytest.raises(ConfigError, match="memory.device_margin: must be a size"):
        parse_settings({"memory": {"device_margin": "plenty"}}, env={})
