"""Bounds on one request (the config's `limits:`), checked before any templating, tokenising or
engine work; over a bound a request gets 400 naming the field, the limit and its config key."""

from __future__ import annotations

from typing import Any, Iterable

from aiohttp import web

from gpushare.api.context import context
from gpushare.api.errors import ApiError, bad_request
from gpushare.settings.limit_settings import LimitSettings


def limits_of(request: web.Request) -> LimitSettings:
    return context(request).settings.limits


def _over(param: str, count: int, what: str, key: str, limit: int) -> ApiError:
    return bad_request(f'"{param}" has {count} {what}, more than the limit of {limit} (limits.{key})', param=param)


def check_count(param: str, count: int, what: str, key: str, limits: LimitSettings) -> None:
    """400 when ``count`` (of ``what``, e.g. "messages") passes ``limits.<key>``."""
    limit = getattr(limits, key)
    if count > limit:
        raise _over(param, count, what, key, limit)


def check_stop(stop: list[str], param: str, limits: LimitSettings) -> None:
    check_count(param, len(stop), "strings", "max_stop_strings", limits)
    for i, s in enumerate(stop):
        check_count(f"{param}[{i}]", len(s), "characters", "max_stop_chars", limits)


def check_prompt_chars(texts: Iterable[str], param: str, limits: LimitSettings) -> None:
    """The request's texts together, before templating or tokenising."""
    check_count(param, sum(len(t) for t in texts), "characters", "max_prompt_chars", limits)


def json_depth_over(value: Any, limit: int) -> bool:
    """Whether ``value`` nests objects/arrays deeper than ``limit`` levels (the top level is 1)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False
