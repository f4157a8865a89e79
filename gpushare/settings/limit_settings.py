"""The `limits:` section of the config: bounds on what one request may ask of the daemon.

Each bound keeps one request from holding the event loop or the engine thread for long (a huge
prompt templated and tokenised, thousands of stop strings checked on every token, an embedding
batch that stops generation meanwhile). Over a bound a request gets 400 naming the field, the
limit and this key; raise the key where a real workload needs more.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from gpushare.settings.values import expect_mapping, positive_int, reject_unknown


@dataclass
class LimitSettings:
    max_prompt_chars: int = 1_000_000  # prompt + system + message texts (or embedding texts), before templating
    max_messages: int = 1024  # chat messages in one request
    max_stop_strings: int = 16  # stop strings in one request
    max_stop_chars: int = 256  # characters in one stop string
    max_embed_inputs: int = 512  # inputs in one embedding request
    max_embed_tokens: int = 65536  # their tokens, together
    max_json_depth: int = 64  # nesting of the JSON request body


def read_limits(raw: Any) -> LimitSettings:
    d = expect_mapping(raw, "limits")
    names = {f.name for f in dataclasses.fields(LimitSettings)}
    reject_unknown(d, names, "limits.")
    return LimitSettings(**{name: positive_int(value, f"limits.{name}") for name, value in d.items()})
