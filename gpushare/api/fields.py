"""Typed reads of JSON request bodies; a wrong type is a 400 that names the field."""

from __future__ import annotations

import json
from typing import Any, Callable

from aiohttp import web

from gpushare.api.context import context
from gpushare.api.errors import ApiError, bad_request
from gpushare.api.limits import check_count, check_prompt_chars, json_depth_over, limits_of
from gpushare.api.work import body_bytes, bounded
from gpushare.settings.settings import ConfigError, parse_duration_s
from gpushare.settings.values import MAX_DURATION_S

JSON_BODY = "gpushare.json_body"  # request key: the body read_json_object parsed (metrics labels refusals by it)

_KINDS = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


async def read_json_object(request: web.Request) -> dict:
    """The body as a JSON object, or 4xx saying why it is not one (too big, too many values, nested too
    deep). Parsed in the work pool (api/work.py), after a bound on its size and on its values."""
    limits = limits_of(request)
    with body_bytes.holding() as hold:  # until it is parsed: the node holds at most server.max_body_bytes_held
        chunks = await _read_body(request, limits.max_body_bytes, hold,
                                  context(request).settings.server.max_body_bytes_held)
        body = await bounded(request, "parsing the request body", parse_json_object, chunks, limits)
    request[JSON_BODY] = body
    return body


async def _read_body(request: web.Request, limit_bytes: int, hold, held_limit_bytes: int) -> list[bytes]:
    """The body as it came, in pieces of at most 1 MiB (joined off the loop); ``hold(size, held_limit_bytes)``
    counts each piece against the node's bound before it is read (the declared length at once)."""
    too_big = ApiError(413, f"request body is larger than the limit of {limit_bytes} bytes (limits.max_body_bytes)")
    declared = request.content_length
    if declared is not None and declared > limit_bytes:
        raise too_big
    if declared is not None:
        hold(declared, held_limit_bytes)
    chunks, size = [], 0
    async for chunk in request.content.iter_chunked(1 << 20):
        size += len(chunk)
        if size > limit_bytes:  # chunked, or a Content-Length that lied
            raise too_big
        past_declared = len(chunk) if declared is None else min(len(chunk), size - declared)
        if past_declared > 0:  # the declared length is held already
            hold(past_declared, held_limit_bytes)
        chunks.append(chunk)
    return chunks


def parse_json_object(chunks: list[bytes], limits) -> dict:
    """The body's pieces parsed, once its values are known to be few enough. The C parser holds the GIL
    from start to end (the event loop waits meanwhile), so the body's "{", "[" and "," are counted
    first, a piece at a time (the loop gets the GIL between pieces): every JSON value but the first
    needs one of them (those inside strings count too: an upper bound)."""
    items = opening = 0
    for chunk in chunks:
        brackets = chunk.count(b"{") + chunk.count(b"[")
        opening += brackets
        items += brackets + chunk.count(b",")
        if items > limits.max_json_items:
            raise bad_request(f"request body has more than {limits.max_json_items} JSON objects, arrays and commas, "
                              f"the limit (limits.max_json_items)")
    raw = b"".join(chunks)
    if not raw or raw.isspace():
        raise bad_request("request body is empty; expected a JSON object")
    too_deep = bad_request(f"request body nests JSON deeper than the limit of {limits.max_json_depth} levels "
                           f"(limits.max_json_depth)")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"invalid JSON in request body: {e}") from None
    except RecursionError:
        raise too_deep from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {_json_type(body)}")
    if opening > limits.max_json_depth and json_depth_over(body, limits.max_json_depth):  # else it cannot be
        raise too_deep
    return body


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    for name, types in _KINDS.items():
        if isinstance(value, types) and name != "number":
            return name
    return "number" if isinstance(value, float) else type(value).__name__


def field(body: dict, key: str, kind: str, default: Any = None, *, prefix: str = "") -> Any:
    """body[key] checked against a JSON kind; missing or null gives `default`."""
    value = body.get(key)
    if value is None:
        return default
    ok = isinstance(value, _KINDS[kind]) and not (kind in ("integer", "number") and isinstance(value, bool))
    if kind == "integer" and isinstance(value, float) and value.is_integer():
        value, ok = int(value), True
    if not ok:
        raise bad_request(f'"{prefix}{key}" must be {_article(kind)} {kind}, got {_json_type(value)} {json.dumps(value)}',
                          param=prefix + key)
    if kind == "number":
        value = float(value)
    return value


def required_string(body: dict, key: str) -> str:
    value = field(body, key, "string")
    if not value:
        raise bad_request(f'"{key}" is required', param=key)
    return value


def string_list(body: dict, key: str, *, prefix: str = "") -> list[str]:
    """A string or an array of strings (OpenAI `stop`, Ollama `options.stop`)."""
    value = body.get(key)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise bad_request(f'"{prefix}{key}" must be a string or an array of strings, got {json.dumps(value)}',
                      param=prefix + key)


def text_parts(value, where: str, types: tuple[str, ...] = ("text",)) -> str:
    """A string, or an array of text parts (``{"type": one of types, "text": ...}``), as one text; 400 naming
    the part that is not one (an image, say)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(f'"{where}" must be a string or an array of text parts', param=where)
    parts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") not in types or not isinstance(part.get("text"), str):
            raise bad_request(f'"{where}[{j}]": only {" and ".join(types)} parts {{"type", "text"}} are supported',
                              param=f"{where}[{j}]")
        parts.append(part["text"])
    return "".join(parts)


def reject_unsupported(body: dict, unsupported: dict[str, str]) -> None:
    """400 naming the first field of ``unsupported`` that the body sets; its value says why."""
    for key, why in unsupported.items():
        if body.get(key):
            raise bad_request(f'"{key}" {why}', param=key)


def message_list(messages: list, roles: dict[str, str], content: Callable[[dict, str], str], limits,
                 extra: Callable[[dict, str], dict] | None = None) -> list[dict]:
    """Chat messages as ``{"role", "content"}``; ``roles`` maps the dialect's roles onto the chat
    template's, ``content(message, where)`` reads one message's text (or raises the dialect's 400),
    ``extra(message, where)`` other keys to keep (tool calls and results).
    At most ``limits.max_messages`` messages of ``limits.max_prompt_chars`` characters in all."""
    check_count("messages", len(messages), "messages", "max_messages", limits)
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f'"{where}" must be an object with "role" and "content"', param=where)
        role = field(m, "role", "string", prefix=where + ".")
        if role not in roles:
            raise bad_request(f'"{where}.role" must be one of {", ".join(roles)}, got {role!r}', param=where + ".role")
        out.append({"role": roles[role], "content": content(m, where), **(extra(m, where) if extra else {})})
    check_prompt_chars((m["content"] for m in out), "messages", limits)
    return out


def keep_alive_s(body: dict) -> float | None:
    """Ollama's keep_alive: seconds as a number, or a duration string ("5m", "-1"); None when absent."""
    value = body.get("keep_alive")
    if value is None:
        return None
    try:
        return parse_duration_s(value, "keep_alive")
    except ConfigError:
        raise bad_request(f'"keep_alive" must be a duration like "5m" or a number of seconds, finite and at most '
                          f'{MAX_DURATION_S:.0f} (ten years; -1 for ever), got {json.dumps(value)}',
                          param="keep_alive") from None


def _article(kind: str) -> str:
    return "an" if kind[0] in "aeiou" else "a"
