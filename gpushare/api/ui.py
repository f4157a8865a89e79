"""GET /ui: the live status page, static files shipped in the package (gpushare/api/ui_files/).

The page holds no data: its script polls /api/status (api/status.py) once a second with the key the
person typed, kept in the tab's sessionStorage and sent as ``Authorization: Bearer``, never in a URL.
So the files themselves need no key (UI_PATHS are open paths in api/tenants.py), and with tenants
configured a page without a key shows no node data. Its load and unload buttons call /api/load and
/api/generate with keep_alive 0, the admin endpoints the CLI uses.

Every file goes out with a Content-Security-Policy that lets the page load its own script, style
and icon and talk to this daemon only: no inline script or style, no eval, no frames, no forms
posting elsewhere, nothing fetched from another host (the node may be offline). The browser rules
of api/browsers.py (Host, Origin) apply to these paths as to the API.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

FILES_DIR = Path(__file__).with_name("ui_files")
CONTENT_TYPES = {"index.html": "text/html; charset=utf-8", "ui.css": "text/css; charset=utf-8",
                 "ui.js": "text/javascript; charset=utf-8",
                 "charts.js": "text/javascript; charset=utf-8", "favicon.svg": "image/svg+xml"}
UI_PATHS = frozenset({"/ui", "/ui/", *(f"/ui/{name}" for name in CONTENT_TYPES)})
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                           "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}


def _served(name: str, body: bytes):
    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPES[name], **SECURITY_HEADERS})
    return handler


def add_routes(app: web.Application) -> None:
    """Read the files once; a missing one is a broken install and fails the daemon's start."""
    bodies = {name: (FILES_DIR / name).read_bytes() for name in CONTENT_TYPES}
    index = _served("index.html", bodies["index.html"])
    app.router.add_get("/ui", index)
    app.router.add_get("/ui/", index)
    for name, body in bodies.items():
        app.router.add_get(f"/ui/{name}", _served(name, body))
