"""GET /api/status: what the status page (/ui, api/ui.py) shows, in one JSON answer a second.

- ``devices`` (admins only): each device's worker (pid, health, restarts) and its share of
  memory.budget: weights, KV committed to models, the rest of its KV pool, other reservations, free;
- ``models``: every model copy loaded, loading, unloading or warm (unloaded, kept built in host
  memory) that the asker may use, with its device and size; a loaded one with its KV blocks,
  requests running and queued, tokens/s (last second) and keep-alive expiry. A tenant that is not
  an admin sees its own share of each, as /api/ps shows it (api/tenant_views.py): its requests and
  KV, and no tokens/s (null: the model's rate is every tenant's);
- ``tenants``: as /api/ps shows them (an admin: every tenant; a tenant: its own row), plus its 429s
  in the last minute;
- ``history`` (admins only): the samples of api/status_history.py newer than ``?since=`` (epoch s).

Models and tenants come PAGE_ROWS at a time: ``?model_filter=&model_offset=`` and
``?tenant_filter=&tenant_offset=`` (a case-insensitive substring of the name), with the totals, so a
node with thousands of tenants answers in a few kilobytes and the page renders a page of rows.
"""

from __future__ import annotations

import time

from aiohttp import web

from gpushare.api.context import context
from gpushare.api.errors import bad_request
from gpushare.api.health import device_rows
from gpushare.api.status_history import HISTORY
from gpushare.api.tenant_views import own_view, seen_model, tenant_rows
from gpushare.api.tenants import gate_of, is_admin, tenant_of, visible

PAGE_ROWS = 50


def _int_param(request: web.Request, name: str) -> int:
    raw = request.query.get(name, "0")
    try:
        value = int(raw)
    except ValueError:
        raise bad_request(f'"{name}" must be a whole number, got {raw!r}', param=name) from None
    if value < 0:
        raise bad_request(f'"{name}" must be 0 or more, got {value}', param=name)
    return value


def _float_param(request: web.Request, name: str) -> float:
    raw = request.query.get(name, "0")
    try:
        return float(raw)
    except ValueError:
        raise bad_request(f'"{name}" must be a number (epoch seconds), got {raw!r}', param=name) from None


def page(request: web.Request, rows: list[dict], prefix: str) -> dict:
    """The rows whose name holds ``?{prefix}_filter``, PAGE_ROWS from ``?{prefix}_offset``, with counts."""
    needle = request.query.get(f"{prefix}_filter", "").lower()
    offset = _int_param(request, f"{prefix}_offset")
    matching = [r for r in rows if needle in r["name"].lower()] if needle else rows
    return {"total": len(rows), "matching": len(matching), "offset": offset,
            "rows": matching[offset:offset + PAGE_ROWS]}


def device_memory(ctx) -> list[dict]:
    """Each device's memory.budget, split into what holds it (residency's own accounting)."""
    residency = ctx.registry.residency
    health = {row["device"]: row for row in device_rows(ctx)}
    rows = []
    for name, device in ctx.registry.devices.items():
        stats = device.stats()
        weights = sum(e.size_bytes for e in residency.entries() if e.device_name == name)
        used = residency.used_bytes(name)
        pool, committed = device.kv_pool_bytes, min(stats.kv_committed_bytes, device.kv_pool_bytes)
        row = health.get(name) or {"device": name, "worker_pid": device.pid, "healthy": True, "restarts": 0}
        rows.append({**row, "kind": device.config.device, "budget_bytes": residency.budget_bytes,
                     "used_bytes": used, "weight_bytes": weights, "kv_pool_bytes": pool,
                     "kv_committed_bytes": committed,
                     "other_bytes": max(0, used - weights - pool),  # loads that found room, a group's share
                     "free_bytes": max(0, residency.budget_bytes - used),
                     "models": sum(1 for e in residency.entries() if e.device_name == name)})
    return rows


def model_rows(request: web.Request) -> list[dict]:
    ctx = context(request)
    history = request.app[HISTORY]
    residency = ctx.registry.residency
    unloading = {id(e) for e in residency.unloading_entries}
    own = own_view(request)  # a tenant of a shared model sees its own requests and KV, as /api/ps shows them
    rows = []
    for entry in [*residency.entries(), *residency.unloading_entries]:
        if not visible(request, [entry.name]):
            continue
        s, requests = seen_model(entry.device.stats().models.get(entry.name), entry.active, own)
        kv_bytes = (s.kv_committed_bytes if s else 0) * entry.device.world_size
        # The model's tokens/s is every tenant's generation: a tenant's own share of it is not counted.
        rate = history.model_tokens_per_s.get((entry.device_name, entry.name), 0.0) if own is None else None
        rows.append({
            "name": entry.name, "device": entry.device_name, "state": "unloading" if id(entry) in unloading else "loaded",
            "size_bytes": entry.weight_bytes + kv_bytes, "weight_bytes": entry.weight_bytes,
            "kv_committed_bytes": kv_bytes, "kv_blocks_used": s.blocks_used if s else 0,
            "kv_blocks_total": s.blocks_total if s else 0, "running": s.running if s else 0,
            "queued": s.waiting if s else 0,
            "requests": requests,
            "tokens_per_s": None if rate is None else round(rate, 3),
            "keep_alive_s": entry.keep_alive_s,
            "expires_at": entry.expires_at,  # epoch s its keep_alive ends; None while busy or kept for ever
            "pinned": entry.source.pinned})
    here = {(e.name, e.device_name) for e in residency.entries()}
    for key, warm in residency.warm.entries():  # key: (digest, dtype, weights, device)
        if warm.name and (warm.name, key[-1]) not in here and visible(request, [warm.name]):
            rows.append({"name": warm.name, "device": key[-1], "state": "warm", "size_bytes": warm.weight_bytes})
    for job in ctx.registry.loading():
        if visible(request, [job.source.name]):
            rows.append({"name": job.source.name, "device": job.device, "state": job.state,
                         "load_progress": round(job.progress, 4), "size_bytes": job.total_bytes,
                         **({"requests": job.waiters} if own is None else {})})  # others' waiters are theirs
    return sorted(rows, key=lambda r: (r["name"], r["device"] or ""))


def tenant_status_rows(request: web.Request) -> list[dict]:
    history = request.app[HISTORY]
    rows = tenant_rows(request)
    for row in rows:
        row["rejected_last_minute"] = history.rejections_last_minute(row["name"])
    return sorted(rows, key=lambda r: r["name"])


async def status(request: web.Request) -> web.Response:
    ctx = context(request)
    admin = is_admin(request)
    tenants_on = gate_of(request).enabled
    body = {
        "time": time.time(), "phase": ctx.phase, "uptime_s": round(time.time() - ctx.started_at, 1),
        "admin": admin, "tenants_enabled": tenants_on, "tenant": tenant_of(request).name if tenants_on else None,
        "models": page(request, model_rows(request), "model"),
        "tenants": page(request, tenant_status_rows(request), "tenant"),
    }
    if admin:  # node-wide figures: the operator's, as /api/ps's memory
        body["devices"] = device_memory(ctx)
        body["history"] = request.app[HISTORY].since(_float_param(request, "since"))
    return web.json_response(body, headers={"Cache-Control": "no-store"})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/api/status", status)
