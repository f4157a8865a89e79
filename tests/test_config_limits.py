"""Config for the hardening: `limits:`, `server.origins`, `server.min_keep_alive`, finite durations,
and errors that never show a tenant's secret (they reach the journal and systemd's STATUS line)."""

import pytest

from gpushare.settings.settings import ConfigError, load_settings, parse_duration_s, parse_settings
from gpushare.settings.limit_settings import LimitSettings

SECRET = "plain-secret-123"


def test_limits_default_and_override():
    assert parse_settings(None, env={}).limits == LimitSettings()
    s = parse_settings({"limits": {"max_stop_strings": 64, "max_embed_tokens": 300000}}, env={})
    assert (s.limits.max_stop_strings, s.limits.max_embed_tokens, s.limits.max_messages) == (64, 300000, 1024)


@pytest.mark.parametrize("raw, message", [
    ({"limits": {"max_stop_strings": 0}}, "limits.max_stop_strings: must be a positive integer, got 0"),
    ({"limits": {"max_prompt": 5}}, "limits.max_prompt: unknown key"),
    ({"server": {"origins": [""]}}, "server.origins: must be a list of origins"),
    ({"server": {"min_keep_alive": "-1"}}, "server.min_keep_alive: must not be negative"),
    ({"server": {"keep_alive": "nan"}}, "server.keep_alive: must be finite"),
    ({"server": {"keep_alive": 1e12}}, "server.keep_alive: must be finite and at most 315360000 seconds"),
])
def test_errors_name_the_key(raw, message):
    with pytest.raises(ConfigError) as info:
        parse_settings(raw, env={})
    assert message in str(info.value)


def test_origins_from_the_file_and_the_environment():
    s = parse_settings({"server": {"origins": ["https://app.example.com"]}},
                       env={"GPUSHARE_ORIGINS": "https://a.test, https://*.b.test"})
    assert s.server.origins == ["https://app.example.com", "https://a.test", "https://*.b.test"]
    assert parse_settings(None, env={}).server.min_keep_alive_s == 60


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", float("nan"), float("inf"), 1e12, "99999999h"])
def test_durations_are_finite_and_bounded(value):
    with pytest.raises(ConfigError, match="must be finite"):
        parse_duration_s(value, "keep_alive")


@pytest.mark.parametrize("tenants", [
    [{"name": "a", "api_keys": SECRET}],
    {"alice": SECRET},
    [f"alice:{SECRET}"],
    [{"name": "a", "api_keys": [{"key": SECRET}]}],
])
def test_tenant_errors_never_show_a_key(tenants):
    with pytest.raises(ConfigError) as info:
        parse_settings({"tenants": tenants}, env={})
    assert "tenants" in str(info.value) and SECRET not in str(info.value)


def test_yaml_and_encoding_errors_never_quote_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f'tenants:\n  - name: a\n    api_keys: ["{SECRET}"\n    admin: true\n')
    with pytest.raises(ConfigError) as info:
        load_settings(bad)
    assert "bad.yaml: not valid YAML: line 4" in str(info.value) and SECRET not in str(info.value)
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(f"# caf\xe9\ntenants: [{{name: a, api_keys: [{SECRET}]}}]\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="latin1.yaml: not UTF-8 text"):
        load_settings(latin1)
