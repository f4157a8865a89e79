"""Settings from the environment: gpushare's own variables, and Ollama's as their fallbacks.

Someone switching from Ollama keeps their environment: each OLLAMA_* variable is read when
its GPUSHARE_* counterpart is unset (or, where gpushare has none, on its own). The
environment outranks the YAML file, as for every GPUSHARE_* variable; `--host` outranks
both. The table is in docs/configuration.md ("Environment").
"""

from __future__ import annotations

import os
from pathlib import Path

from gpushare.settings.values import ConfigError, non_negative_int, parse_duration_s, parse_host, positive_int

# Where Ollama keeps its models when OLLAMA_MODELS is unset: a user's own, and the system service's.
OLLAMA_STORES = ("~/.ollama/models", "/usr/share/ollama/.ollama/models")

# (gpushare's variable or None, Ollama's variable, the setting it sets)
ENV_VARS = [
    ("GPUSHARE_HOST", "OLLAMA_HOST", "server.host"),
    ("GPUSHARE_KEEP_ALIVE", "OLLAMA_KEEP_ALIVE", "server.keep_alive"),
    ("GPUSHARE_ORIGINS", "OLLAMA_ORIGINS", "server.origins (added to the file's)"),
    (None, "OLLAMA_MAX_QUEUE", "server.max_queued"),
    (None, "OLLAMA_CONTEXT_LENGTH", "server.context_length"),
    (None, "OLLAMA_NUM_PARALLEL", "engine.max_num_seqs"),
    (None, "OLLAMA_MAX_LOADED_MODELS", "memory.max_loaded_models"),
    ("GPUSHARE_MODELS", None, "models_dir"),
    (None, "OLLAMA_MODELS", "ollama_models (the Ollama store read)"),
]


def env_value(env, gpushare_name: str | None, ollama_name: str | None) -> tuple[str | None, str]:
    """(value, the variable it came from): gpushare's variable first, then Ollama's."""
    for name in (gpushare_name, ollama_name):
        if name and env.get(name):
            return env[name], name
    return None, ""


def daemon_host(env=None) -> str | None:
    """The daemon's address the CLI talks to (GPUSHARE_HOST, else OLLAMA_HOST); None: the default."""
    value, _ = env_value(os.environ if env is None else env, "GPUSHARE_HOST", "OLLAMA_HOST")
    return value


def ollama_stores(raw, env) -> list[Path]:
    """The `ollama_models` setting: a path or a list of paths; `false` or [] reads no store.
    Unset: $OLLAMA_MODELS, else Ollama's default places."""
    if env.get("OLLAMA_MODELS"):
        raw = env["OLLAMA_MODELS"]
    elif raw is None:
        raw = list(OLLAMA_STORES)
    if raw is False:
        return []
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not all(isinstance(p, str) and p.strip() for p in items):
        raise ConfigError(f"ollama_models: must be a path, a list of paths or false, got {raw!r}")
    return [Path(p).expanduser() for p in items]


def apply_environment(s, env, read_origins) -> None:
    """Apply the variables of ENV_VARS to Settings `s` (all but the two that choose folders)."""
    value, name = env_value(env, "GPUSHARE_HOST", "OLLAMA_HOST")
    if value:
        parse_host(value, name)
        s.server.host = value
    value, name = env_value(env, "GPUSHARE_ORIGINS", "OLLAMA_ORIGINS")
    if value:
        s.server.origins = [*s.server.origins, *read_origins(value, name)]
    value, name = env_value(env, "GPUSHARE_KEEP_ALIVE", "OLLAMA_KEEP_ALIVE")
    if value:
        s.server.keep_alive_s = parse_duration_s(value, name)
    for name, section, key, read in (("OLLAMA_MAX_QUEUE", s.server, "max_queued", non_negative_int),
                                     ("OLLAMA_CONTEXT_LENGTH", s.server, "context_length", positive_int),
                                     ("OLLAMA_NUM_PARALLEL", s.engine, "max_num_seqs", positive_int),
                                     ("OLLAMA_MAX_LOADED_MODELS", s.memory, "max_loaded_models", positive_int)):
        if env.get(name):
            try:
                number = int(env[name])
            except ValueError:
                raise ConfigError(f"{name}: must be an integer, got {env[name]!r}") from None
            setattr(section, key, read(number, name))
