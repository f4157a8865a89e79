"""Liveness and readiness: /health, /ready, and the middleware that turns requests away while draining.

/health answers 200 while the process runs and the engine loop ticks (the engine
refreshes `last_tick_s` every turn, also when idle), 503 once the loop has been silent
for `ApiContext.engine_stall_s`: a load balancer or kubelet restarts a wedged daemon.
/ready answers 200 only while serving; 503 while starting (preloads) or draining, so
traffic moves elsewhere before the daemon stops, and once the engine loop has failed for good
(both then name the failure). Both answer JSON and are never refused.

While draining (after SIGTERM) every other request gets 503 with `Retry-After`, in the
dialect of its path; requests already in flight run on. The middleware also counts
those in flight, which the drain waits on.
"""

from __future__ import annotations

import time

from aiohttp import web

from gpushare.api.context import context
from gpushare.api.errors import ApiError

MONITORING_PATHS = frozenset({"/health", "/ready", "/metrics", "/metrics/gateway"})
DRAIN_RETRY_AFTER_S = 5


def engine_alive(engine, stall_s: float) -> bool:
    """The engine thread runs, has not failed, and its loop turned within the last `stall_s` seconds.

    A failing loop sets ``failure`` before it ends the streams and before its thread exits: a
    client that sees its stream end with the error then sees the engine down here too."""
    return engine.alive() and not engine.failure and time.monotonic() - engine.last_tick_s < stall_s


async def health(request: web.Request) -> web.Response:
    ctx = context(request)
    silent_s = time.monotonic() - ctx.engine.last_tick_s
    alive = engine_alive(ctx.engine, ctx.engine_stall_s)
    stalled = ctx.engine.alive() and not ctx.engine.failure
    body = {"status": "ok" if alive else "engine stalled" if stalled else "engine stopped",
            "engine_last_tick_s_ago": round(silent_s, 3), **_failure(ctx.engine)}
    return web.json_response(body, status=200 if alive else 503)


def _failure(engine) -> dict:
    return {"error": engine.failure} if engine.failure else {}


async def ready(request: web.Request) -> web.Response:
    ctx = context(request)
    if ctx.engine.failure:
        return web.json_response({"status": "engine failed", **_failure(ctx.engine)}, status=503)
    return web.json_response({"status": ctx.phase}, status=200 if ctx.phase == "serving" else 503)


@web.middleware
async def drain_middleware(request: web.Request, handler):
    """503 for new work once draining began; counts the requests in flight (monitoring excluded)."""
    if request.path in MONITORING_PATHS:
        return await handler(request)
    ctx = context(request)
    if ctx.phase == "draining":
        raise ApiError(503, "the daemon is shutting down; retry on another node or after its restart",
                       retry_after_s=DRAIN_RETRY_AFTER_S)
    ctx.in_flight += 1
    try:
        return await handler(request)
    finally:
        ctx.in_flight -= 1


def add_routes(app: web.Application) -> None:
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
