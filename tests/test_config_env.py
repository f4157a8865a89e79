"""Ollama's environment variables as fallbacks for gpushare's, read by the daemon's settings."""

import pytest

from gpushare.settings.settings import ConfigError, parse_settings


def test_ollama_variables_set_their_keys():
    s = parse_settings({"models": []}, env={
        "OLLAMA_HOST": "0.0.0.0:11500", "OLLAMA_KEEP_ALIVE": "10m",
        "OLLAMA_ORIGINS": "https://a.example,https://b.example",
        "OLLAMA_MAX_QUEUE": "7", "OLLAMA_CONTEXT_LENGTH": "4096", "OLLAMA_NUM_PARALLEL": "3",
        "OLLAMA_MAX_LOADED_MODELS": "2", "OLLAMA_MODELS": "/srv/ollama"})
    assert s.server.host == "0.0.0.0:11500" and s.server.keep_alive_s == 600
    assert s.server.origins == ["https://a.example", "https://b.example"]
    assert (s.server.max_queued, s.server.context_length, s.engine.max_num_seqs, s.memory.max_loaded_models) == \
        (7, 4096, 3, 2)
    assert [str(p) for p in s.ollama_models] == ["/srv/ollama"]


def test_gpushare_variables_win_and_the_env_outranks_the_file():
    s = parse_settings({"models": [], "server": {"host": "127.0.0.1:1"}, "memory": {"max_loaded_models": 5}},
                       env={"GPUSHARE_HOST": "127.0.0.1:2", "OLLAMA_HOST": "127.0.0.1:3",
                            "OLLAMA_MAX_LOADED_MODELS": "1"})
    assert s.server.host == "127.0.0.1:2" and s.memory.max_loaded_models == 1


def test_the_default_stores_and_turning_them_off():
    s = parse_settings({"models": []}, env={})
    assert [str(p) for p in s.ollama_models][1] == "/usr/share/ollama/.ollama/models"
    assert parse_settings({"models": [], "ollama_models": False}, env={}).ollama_models == []


@pytest.mark.parametrize("env, message", [
    ({"OLLAMA_NUM_PARALLEL": "many"}, "OLLAMA_NUM_PARALLEL: must be an integer, got 'many'"),
    ({"OLLAMA_CONTEXT_LENGTH": "0"}, "OLLAMA_CONTEXT_LENGTH: must be a positive integer"),
    ({"OLLAMA_HOST": "host:99999"}, "OLLAMA_HOST: must be HOST:PORT"),
    ({"OLLAMA_KEEP_ALIVE": "soon"}, "OLLAMA_KEEP_ALIVE: must be a duration"),
])
def test_bad_values_name_the_variable(env, message):
    with pytest.raises(ConfigError) as info:
        parse_settings({"models": []}, env=env)
    assert str(info.value).startswith(message)


def test_model_options_in_the_config_are_checked(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    s = parse_settings({"models": [{"name": "m", "path": str(model), "options": {"temperature": 0, "stop": "x"},
                                    "system": "Be brief."}]}, tmp_path, env={})
    assert s.models[0].options == {"temperature": 0.0, "stop": ["x"]} and s.models[0].system == "Be brief."
    with pytest.raises(ConfigError) as info:
        parse_settings({"models": [{"name": "m", "path": str(model), "options": {"temprature": 0}}]}, tmp_path,
                       env={})
    assert str(info.value).startswith("models[0].options.temprature: unknown parameter 'temprature'")
