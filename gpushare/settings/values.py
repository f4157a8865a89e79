"""Typed reading of single config values: durations, sizes, host:port, and checked scalars.

Every error is a ConfigError whose message names the key, e.g. ``server.host: ...``.
"""

from __future__ import annotations

import math
import re
from typing import Any

DEFAULT_PORT = 11434
MAX_DURATION_S = 10 * 365 * 86400.0  # ten years; longer is "for ever" (-1), and times past it overflow dates


class ConfigError(ValueError):
    """A setting is missing, of the wrong type or out of range; the message names the key."""


_DURATION_PART_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_DURATION_UNIT_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_UNIT = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_duration_s(value: Any, key: str = "duration") -> float:
    """Seconds from a number (seconds) or a Go-style string as Ollama takes: "30s", "5m", "1h30m", "-1".

    Finite and at most MAX_DURATION_S either way (a negative duration means "for ever" where allowed)."""
    seconds = _duration_s(value, key)
    if not math.isfinite(seconds) or abs(seconds) > MAX_DURATION_S:
        raise ConfigError(f"{key}: must be finite and at most {MAX_DURATION_S:.0f} seconds (ten years) either way; "
                          f"use -1 for ever, got {value!r}")
    return seconds


def _duration_s(value: Any, key: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        text = value.strip().replace(" ", "")
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            return sign * float(body)
        except ValueError:
            pass
        parts = _DURATION_PART_RE.findall(body)
        if parts and "".join(n + u for n, u in parts) == body:
            return sign * sum(float(n) * _DURATION_UNIT_S[u] for n, u in parts)
    raise ConfigError(f"{key}: must be a duration like 30s, 5m or a number of seconds, got {value!r}")


def parse_size_bytes(value: Any, key: str = "size") -> int:
    """Bytes from an integer or a string like "512MiB", "8GiB", "2GB"."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            return int(float(m.group(1)) * _SIZE_UNIT[(m.group(2) or "B").lower()])
    raise ConfigError(f"{key}: must be a size like 512MiB or 8GiB or a number of bytes, got {value!r}")


def positive_size_bytes(value: Any, key: str, example: str) -> int:
    """parse_size_bytes, refusing zero and less (``example``: a size to suggest, like 64MiB)."""
    size = parse_size_bytes(value, key)
    if size <= 0:
        raise ConfigError(f"{key}: must be a positive size like {example}, got {value!r}")
    return size


def parse_host(value: str, key: str = "server.host") -> tuple[str, int]:
    """(host, port) from "HOST:PORT", "HOST", ":PORT" or "http://HOST:PORT", as OLLAMA_HOST."""
    text = str(value).strip()
    text = re.sub(r"^[a-z]+://", "", text).rstrip("/")
    if text.startswith("["):  # [::1]:port
        host, _, rest = text[1:].partition("]")
        port_text = rest.lstrip(":")
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:
        host, port_text = text, ""
    host = host or "127.0.0.1"
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"{key}: must be HOST:PORT with a port in 1..65535, got {value!r}")
    return host, int(port_text)


# ---------------------------------------------------------------------------- section readers

def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def described(value: Any, quote_strings: bool = True) -> str:
    """A bad value as an error shows it: a list or mapping by its type and size, never its items (a
    whole document's, API keys included, would reach the journal and STATUS=); a string by its
    length when ``quote_strings`` is false."""
    if isinstance(value, dict):
        return f"a mapping of {_count(len(value), 'key')}"
    if isinstance(value, (list, tuple)):
        return f"a list of {_count(len(value), 'item')}"
    if isinstance(value, str) and not quote_strings:
        return f"a string of {_count(len(value), 'character')}"
    return f"{type(value).__name__} {value!r}"


def expect_mapping(value: Any, key: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: must be a mapping, got {described(value, quote_strings=False)}")
    return value


def reject_unknown(section: dict, known: set[str], prefix: str) -> None:
    for k in section:
        if k not in known:
            raise ConfigError(f"{prefix}{k}: unknown key (known: {', '.join(sorted(known))})")


def positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{key}: must be a positive integer, got {value!r}")
    return value


def non_negative_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{key}: must be a non-negative integer, got {value!r}")
    return value


def choice(value: Any, choices: tuple[str, ...], key: str) -> str:
    if value not in choices:
        raise ConfigError(f"{key}: must be one of {', '.join(choices)}, got {value!r}")
    return value


def positive_number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{key}: must be a positive number, got {value!r}")
    return float(value)
