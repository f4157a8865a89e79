"""Liveness and readiness: /health, /ready, and the middleware that turns requests away while draining.

/health answers 200 while the daemon runs and no running engine is stalled (each engine
refreshes `last_tick_s` every turn, also when idle, and its snapshot carries it): 503 once one
has been silent for `ApiContext.engine_stall_s`, so a load balancer or kubelet restarts a wedged
daemon. A device whose worker died and is being restarted does not fail it: the body lists every
device with its worker pid, health and restarts. /ready answers 200 only while serving; 503 while
starting (preloads) or draining, so traffic moves elsewhere before the daemon stops, and once
every engine has failed for good (both then name the failure). Both answer JSON and are never
refused.

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


def engine_alive(engines, stall_s: float) -> bool:
    """No running engine is stalled (silent for `stall_s` seconds), and not every engine has failed."""
    return not engines.failure and not engines.stalled(stall_s)


def device_rows(ctx) -> list[dict]:
    """Each device's worker: its pid (a tensor-parallel group's: its first rank's, and every rank's
    in rank_pids), whether placement may use it, why not, how often it restarted."""
    supervisor = ctx.supervisor
    if supervisor is None:
        return []
    now_s = time.monotonic()
    rows = []
    for name, client in supervisor.clients.items():
        status = supervisor.status[name]
        alive = client.alive()
        rows.append({"device": name, "worker_pid": client.pid if alive else None,
                     **({"rank_pids": client.pids if alive else []} if client.world_size > 1 else {}),
                     "healthy": status.healthy, "restarts": status.restarts,
                     "last_tick_s_ago": round(now_s - client.last_tick_s, 3) if alive else None,
                     **({"reason": status.reason} if status.reason else {})})
    return rows


async def health(request: web.Request) -> web.Response:
    ctx = context(request)
    silent_s = time.monotonic() - ctx.node.last_tick_s
    alive = engine_alive(ctx.node, ctx.engine_stall_s)
    body = {"status": "ok" if alive else "engine stopped" if ctx.node.failure else "engine stalled",
            "engine_last_tick_s_ago": round(silent_s, 3), **_failure(ctx.node)}
    devices = device_rows(ctx)
    if devices:
        body["devices"] = devices
    return web.json_response(body, status=200 if alive else 503)


def _failure(engine) -> dict:
    return {"error": engine.failure} if engine.failure else {}


async def ready(request: web.Request) -> web.Response:
    ctx = context(request)
    if ctx.node.failure:
        return web.json_response({"status": "engine failed", **_failure(ctx.node)}, status=503)
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
