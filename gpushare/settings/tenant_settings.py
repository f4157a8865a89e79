"""The `tenants:` and `prefix_cache:` sections of the config: API keys, KV amounts, limits, shares."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

from gpushare.settings.values import (ConfigError, choice, expect_mapping, non_negative_int, parse_size_bytes,
                                    positive_int, positive_number, reject_unknown)
from gpushare.protocol.tenant_policy import PRIORITIES

PREFIX_CACHE_SCOPES = ("tenant", "global", "off")


@dataclass
class TenantSettings:
    """One tenant (see `tenants:` in configs/reference.yaml); KV amounts are in bytes or tokens."""
    name: str
    api_key_sha256: list[str] = field(default_factory=list)  # hex digests; plain keys are hashed on reading
    kv_reserved_bytes: int = 0
    kv_reserved_tokens: int = 0
    kv_limit_bytes: int | None = None  # None: no ceiling
    kv_limit_tokens: int | None = None
    max_concurrent: int | None = None  # None: no limit of its own
    max_queued: int | None = None  # None: no limit of its own (the node's server.max_queued still holds)
    requests_per_s: float | None = None
    tokens_per_min: int | None = None
    weight: float = 1.0
    priority: str = "interactive"
    models: list[str] | None = None  # None: every model; else names or fnmatch patterns
    admin: bool = False  # sees every tenant's row in /api/ps


_TENANT_KEYS = {"name", "api_keys", "kv_reserved", "kv_limit", "max_concurrent", "max_queued", "rate_limit",
                "weight", "priority", "models", "admin"}
_TENANT_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")
_SHA256_KEY_RE = re.compile(r"^sha256:([0-9a-fA-F]{64})$")
_TOKENS_RE = re.compile(r"^\s*(\d+)\s*(?:tok|tokens)\s*$")


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _kv_amount(value: Any, key: str) -> tuple[int, int]:
    """(bytes, tokens) from "512MiB" / a byte count, or "8192tok"; the other one is 0."""
    m = _TOKENS_RE.match(value) if isinstance(value, str) else None
    if m:
        return 0, int(m.group(1))
    try:
        return parse_size_bytes(value, key), 0
    except ConfigError:
        raise ConfigError(f"{key}: must be a size like 512MiB or a token count like 8192tok, got {value!r}") from None



def _redacted(value: Any) -> str:
    """What a value is, never what it says: this section holds secrets, and its errors reach the
    journal and systemd's STATUS line."""
    size = f" of length {len(value)}" if isinstance(value, (str, list, dict)) else ""
    return f"{type(value).__name__} value{size} (not shown)"


def _read_api_keys(raw: Any, key: str) -> list[str]:
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{key}: required, a list of keys (plain, or sha256:<64 hex digits>), got {_redacted(raw)}")
    digests = []
    for j, k in enumerate(raw):
        if not isinstance(k, str) or not k.strip():
            raise ConfigError(f"{key}[{j}]: must be a non-empty string, got {_redacted(k)}")
        m = _SHA256_KEY_RE.match(k.strip())
        if k.strip().startswith("sha256:") and not m:
            raise ConfigError(f"{key}[{j}]: sha256: must be followed by 64 hex digits")
        digests.append(m.group(1).lower() if m else hash_api_key(k.strip()))
    return digests


def _read_tenant(d: dict, key: str) -> TenantSettings:
    reject_unknown(d, _TENANT_KEYS, key + ".")
    name = d.get("name")
    if not isinstance(name, str) or not _TENANT_NAME_RE.match(name):
        raise ConfigError(f"{key}.name: required, 1-64 letters, digits or _.@- (starting with a letter or "
                          f"digit), got {name!r}")
    t = TenantSettings(name=name, api_key_sha256=_read_api_keys(d.get("api_keys"), f"{key}.api_keys"))
    if d.get("kv_reserved") is not None:
        t.kv_reserved_bytes, t.kv_reserved_tokens = _kv_amount(d["kv_reserved"], f"{key}.kv_reserved")
    if d.get("kv_limit") is not None:
        limit_bytes, limit_tokens = _kv_amount(d["kv_limit"], f"{key}.kv_limit")
        if limit_bytes + limit_tokens == 0:
            raise ConfigError(f"{key}.kv_limit: must be more than zero (leave it out for no limit)")
        t.kv_limit_bytes, t.kv_limit_tokens = (limit_bytes, None) if limit_bytes else (None, limit_tokens)
        over = (t.kv_limit_bytes is not None and t.kv_reserved_bytes > t.kv_limit_bytes) or \
               (t.kv_limit_tokens is not None and t.kv_reserved_tokens > t.kv_limit_tokens)
        if over:
            raise ConfigError(f"{key}.kv_reserved: must not exceed {key}.kv_limit ({d['kv_limit']!r}), "
                              f"got {d.get('kv_reserved')!r}")
    if d.get("max_concurrent") is not None:
        t.max_concurrent = positive_int(d["max_concurrent"], f"{key}.max_concurrent")
    if d.get("max_queued") is not None:
        t.max_queued = non_negative_int(d["max_queued"], f"{key}.max_queued")
        if t.max_concurrent is None:
            raise ConfigError(f"{key}.max_queued: needs {key}.max_concurrent (requests queue only beyond it)")
    rate = expect_mapping(d.get("rate_limit"), f"{key}.rate_limit")
    reject_unknown(rate, {"requests_per_s", "tokens_per_min"}, f"{key}.rate_limit.")
    if rate.get("requests_per_s") is not None:
        t.requests_per_s = positive_number(rate["requests_per_s"], f"{key}.rate_limit.requests_per_s")
    if rate.get("tokens_per_min") is not None:
        t.tokens_per_min = positive_int(rate["tokens_per_min"], f"{key}.rate_limit.tokens_per_min")
    if "weight" in d:
        t.weight = positive_number(d["weight"], f"{key}.weight")
    if "priority" in d:
        t.priority = choice(d["priority"], PRIORITIES, f"{key}.priority")
    if d.get("models") is not None:
        models = d["models"]
        if not isinstance(models, list) or not all(isinstance(m, str) and m.strip() for m in models):
            raise ConfigError(f"{key}.models: must be a list of model names (or patterns like llama*), got {models!r}")
        t.models = [m.strip() for m in models]
    if "admin" in d:
        if not isinstance(d["admin"], bool):
            raise ConfigError(f"{key}.admin: must be true or false, got {d['admin']!r}")
        t.admin = d["admin"]
    return t


def read_tenants(raw: Any, pool_bytes: int) -> list[TenantSettings]:
    """The tenants; `pool_bytes` is the engine's KV pool (memory.kv_budget), which reservations must fit."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ConfigError(f"tenants: must be a list of {{name, api_keys, ...}} mappings, got {_redacted(raw)}")
    tenants: list[TenantSettings] = []
    key_owner: dict[str, str] = {}
    for i, item in enumerate(raw):
        key = f"tenants[{i}]"
        if not isinstance(item, dict):
            raise ConfigError(f"{key}: must be a mapping {{name, api_keys, ...}}, got {_redacted(item)}")
        t = _read_tenant(item, key)
        if any(t.name == other.name for other in tenants):
            raise ConfigError(f"{key}.name: duplicate tenant name {t.name!r}")
        for digest in t.api_key_sha256:
            if digest in key_owner:
                raise ConfigError(f"{key}.api_keys: a key of tenant {t.name!r} is also a key of tenant "
                                  f"{key_owner[digest]!r}; each key names one tenant")
            key_owner[digest] = t.name
        tenants.append(t)
    reserved = sum(t.kv_reserved_bytes for t in tenants)
    if reserved > pool_bytes:
        raise ConfigError(f"tenants: kv_reserved adds up to {reserved} bytes, more than the KV pool "
                          f"(memory.kv_budget = {pool_bytes} bytes)")
    return tenants


def read_prefix_cache(raw: Any) -> str:
    d = expect_mapping(raw, "prefix_cache")
    reject_unknown(d, {"scope"}, "prefix_cache.")
    return choice(d.get("scope", "tenant"), PREFIX_CACHE_SCOPES, "prefix_cache.scope")
