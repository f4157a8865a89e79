"""What /api/ps shows a tenant: its own row, and its own share of each model it may use.

With tenants, a tenant that is not an admin sees only its own figures: another tenant's running
and queued requests or KV use on a model they share would tell it what that tenant is doing. An
admin (and everyone, without tenants) sees every tenant's row and whole models.
"""

from __future__ import annotations

from dataclasses import replace

from aiohttp import web

from gpushare.api.context import context
from gpushare.api.tenants import gate_of, is_admin, tenant_of
from gpushare.protocol.engine_stats import ModelStats, TenantModelStats
from gpushare.protocol.tenant_policy import TenantStats


def own_view(request: web.Request) -> str | None:
    """The tenant whose share of each model /api/ps shows; None: everyone's (no tenants, or an admin)."""
    return None if is_admin(request) else tenant_of(request).name


def tenant_share(stats: ModelStats, tenant: str) -> ModelStats:
    """A model's stats as one of its tenants sees them: its own running, queued and KV blocks; the
    committed KV bytes are its blocks' bytes (the slabs the model holds serve every tenant)."""
    mine = stats.tenants.get(tenant) or TenantModelStats()
    return replace(stats, running=mine.running, waiting=mine.waiting, blocks_used=mine.blocks_used,
                   cached_blocks=0, kv_committed_bytes=mine.blocks_used * stats.block_bytes, tenants={})


def seen_model(stats: ModelStats | None, active: int, own: str | None) -> tuple[ModelStats | None, int]:
    """A loaded model's stats and requests (``active``: every tenant's) as the ``own_view`` tenant sees them."""
    if own is None or stats is None:
        return stats, active if own is None else 0
    mine = tenant_share(stats, own)
    return mine, mine.running + mine.waiting


def tenant_rows(request: web.Request) -> list[dict]:
    """/api/ps rows: the asking tenant's own, every tenant's for an admin."""
    gate, me = gate_of(request), tenant_of(request)
    stats = context(request).node.tenant_stats()
    states = list(gate.states.values()) if me.settings.admin else [me]
    rows = []
    for state in states:
        s = stats.get(state.name) or TenantStats()
        rows.append({
            "name": state.name, "kv_used_bytes": s.kv_used_bytes, "kv_reserved_bytes": s.kv_reserved_bytes,
            "kv_limit_bytes": s.kv_limit_bytes,
            "running": s.running,  # sequences in the engine's batches
            "queued": s.waiting + len(state.waiters),  # waiting in the engine, or in this tenant's queue here
            "requests": state.running + len(state.waiters),  # admitted by this layer, or queued in it
            "computed_tokens": s.computed_tokens, "generated_tokens": s.generated_tokens,
            "prefix_hit_tokens": s.prefix_hit_tokens, "priority": state.settings.priority,
            "weight": state.settings.weight, "max_concurrent": state.settings.max_concurrent,
            "max_queued": state.max_queued if state.settings.max_concurrent is not None else None,
        })
    return rows
