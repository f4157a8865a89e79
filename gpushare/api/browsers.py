"""Web browsers: which pages may call the daemon (Origin, CORS), DNS rebinding (Host), and no
request a page can send without a CORS preflight (JSON content type).

A web page can make the browser send requests to 127.0.0.1:11434. Three checks, as Ollama's:
- Origin: a request that carries an ``Origin`` header must come from an allowed origin
  (``server.origins`` added to the defaults: localhost, 127.0.0.1 and [::1] on any port, and
  app schemes such as app://, file://, tauri://, vscode-webview://), else 403. Allowed origins
  get CORS headers, and their preflight (OPTIONS) is answered here, before any API key is asked.
- Host: while the daemon listens on loopback only, the ``Host`` header must name loopback
  (localhost, *.localhost, 127.x.y.z, [::1], any port), else 403: a rebound DNS name (a page's
  own domain resolving to 127.0.0.1) never reaches the API.
- Content type: a browser request (it carries ``Origin`` or ``Sec-Fetch-*``) with a body must
  say ``application/json``, else 415; text/plain, forms and multipart are what a page may send
  without a preflight. Other clients (curl -d sends a form type) are not browsers and may omit it.
"""

from __future__ import annotations

import ipaddress
import re

from aiohttp import web

from gpushare.api.context import context
from gpushare.api.errors import ApiError
from gpushare.settings.values import parse_host

DEFAULT_ORIGINS = tuple(f"{scheme}://{host}{port}" for host in ("localhost", "127.0.0.1", "[::1]")
                        for scheme in ("http", "https") for port in ("", ":*")) + (
    "app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*")
ALLOW_METHODS = "GET, POST, PUT, PATCH, DELETE, HEAD, OPTIONS"
ALLOW_HEADERS = "Authorization, Content-Type, Accept, User-Agent, X-Requested-With, X-Api-Key"
PREFLIGHT_MAX_AGE_S = 86400
BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def origin_allowed(origin: str, extra: list[str]) -> bool:
    """Whether ``origin`` matches a default or an ``extra`` pattern (``*`` matches anything, nothing else is special)."""
    origin = origin.lower()
    return any(re.fullmatch(re.escape(p.lower()).replace(r"\*", ".*"), origin) for p in (*DEFAULT_ORIGINS, *extra))


def _hostname(host_header: str) -> str:
    """The name or address of a Host header, without its port or brackets."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def is_loopback(host: str) -> bool:
    name = _hostname(host)
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _is_json(content_type: str) -> bool:
    return content_type == "application/json" or (content_type.startswith("application/")
                                                  and content_type.endswith("+json"))


@web.middleware
async def browser_middleware(request: web.Request, handler):
    settings = context(request).settings.server
    host = request.headers.get("Host", "")
    if host and is_loopback(parse_host(settings.host)[0]) and not is_loopback(host):
        raise ApiError(403, f"Host {host!r} is not this daemon's: it listens on loopback only (a DNS rebinding "
                            f"page would send its own name); use localhost or 127.0.0.1", code="host_not_allowed")
    origin = request.headers.get("Origin")
    if origin is not None and not origin_allowed(origin, settings.origins):
        raise ApiError(403, f"Origin {origin!r} is not allowed; add it to server.origins", code="origin_not_allowed")
    if origin is not None and request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
        requested = request.headers.get("Access-Control-Request-Headers")
        return web.Response(status=204, headers={
            "Access-Control-Allow-Origin": origin, "Vary": "Origin", "Access-Control-Allow-Methods": ALLOW_METHODS,
            "Access-Control-Allow-Headers": requested or ALLOW_HEADERS,
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S)})
    browser = origin is not None or any(h.startswith("Sec-Fetch-") for h in request.headers)
    if browser and request.method in BODY_METHODS and request.can_read_body and not _is_json(request.content_type):
        raise ApiError(415, f"a request body from a browser must be JSON (Content-Type: application/json), "
                            f"got {request.content_type!r}", code="unsupported_media_type")
    return await handler(request)


async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: an allowed origin may read the answer (streams included)."""
    origin = request.headers.get("Origin")
    if origin is not None and origin_allowed(origin, context(request).settings.server.origins):
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers.add("Vary", "Origin")
