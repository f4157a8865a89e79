"""The `limits:` section of the config: bounds on what one request may ask of the daemon.

Each bound keeps one request from holding the event loop or the engine thread for long (a huge
prompt templated and tokenised, thousands of stop strings checked on every token, an embedding
batch that stops generation meanwhile, thousands of tool schemas compiled, a body of millions of
JSON values, a chat template that never ends). Over a bound a request gets 4xx naming the field,
the limit and this key; raise the key where a real workload needs more.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from gpushare.settings.values import ConfigError, expect_mapping, parse_duration_s, positive_int, positive_size_bytes, \
    reject_unknown


@dataclass
class LimitSettings:
    max_prompt_chars: int = 1_000_000  # message texts, tool descriptions and tool-call arguments, before templating
    max_messages: int = 1024  # chat messages in one request
    max_stop_strings: int = 16  # stop strings in one request
    max_stop_chars: int = 256  # characters in one stop string
    max_embed_inputs: int = 512  # inputs in one embedding request
    max_embed_tokens: int = 65536  # their tokens, together
    max_json_depth: int = 64  # nesting of the JSON request body
    max_body_bytes: int = 64 << 20  # the request body, as sent
    max_json_items: int = 200_000  # "{", "[" and "," in the body: a bound on its JSON values, counted before parsing
    max_tools: int = 128  # tools in one request (OpenAI's own limit)
    max_schema_chars: int = 131_072  # JSON text of a format schema, or of all tools' parameters together
    work_timeout_s: float = 10.0  # a request's work before the engine: parsing, schema checks, chat template, tokens


_SIZES = {"max_body_bytes"}
_DURATIONS = {"work_timeout_s": "work_timeout"}  # field -> config key


def read_limits(raw: Any) -> LimitSettings:
    d = expect_mapping(raw, "limits")
    keys = {_DURATIONS.get(f.name, f.name): f.name for f in dataclasses.fields(LimitSettings)}
    reject_unknown(d, set(keys), "limits.")
    values = {}
    for key, value in d.items():
        name = keys[key]
        if name in _DURATIONS:
            seconds = parse_duration_s(value, f"limits.{key}")
            if seconds <= 0:
                raise ConfigError(f"limits.{key}: must be a positive duration like 10s, got {value!r}")
            values[name] = seconds
        elif name in _SIZES:
            values[name] = positive_size_bytes(value, f"limits.{key}", "64MiB")
        else:
            values[name] = positive_int(value, f"limits.{key}")
    return LimitSettings(**values)
