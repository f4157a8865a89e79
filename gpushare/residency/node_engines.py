"""Every device's engine seen as one, for what is node-wide: merged snapshots (per-model and
per-tenant stats, for /api/ps, /metrics and the status line), tenant policies sent to every
engine, liveness. Requests never go through here: they go to the device their model is on
(``Lease.engine``)."""

from __future__ import annotations

import time

from gpushare.engine.engine_stats import EngineStats
from gpushare.engine.tenants import TenantPolicy, TenantStats

_SUMMED_TENANT_FIELDS = ("kv_used_bytes", "running", "waiting", "computed_tokens", "generated_tokens",
                         "prefix_hit_tokens")


class NodeEngines:
    def __init__(self, devices: dict):
        self.devices = devices  # name -> device (residency/devices.py)
        self.tenant_policies: dict[str, TenantPolicy] = {}

    @property
    def config(self):
        """The engines' shared settings (every device's engine is configured alike)."""
        return next(iter(self.devices.values())).config

    def stats(self) -> EngineStats:
        parts = [d.stats() for d in self.devices.values()]
        merged = EngineStats(sum(p.steps for p in parts), kv_pool_bytes=sum(p.kv_pool_bytes for p in parts),
                             kv_committed_bytes=sum(p.kv_committed_bytes for p in parts),
                             kv_dtype=next((p.kv_dtype for p in parts if p.kv_dtype), ""),
                             max_num_seqs=self.config.max_num_seqs)
        for part in parts:
            merged.models.update(part.models)
        return merged

    def tenant_stats(self) -> dict[str, TenantStats]:
        merged: dict[str, TenantStats] = {}
        for device in self.devices.values():
            for name, t in device.tenant_stats().items():
                into = merged.get(name)
                if into is None:
                    merged[name] = TenantStats(**vars(t))
                    continue
                for field in _SUMMED_TENANT_FIELDS:
                    setattr(into, field, getattr(into, field) + getattr(t, field))
        return merged

    def set_tenants(self, policies: list[TenantPolicy]) -> None:
        self.tenant_policies = {p.name: p for p in policies}
        for device in self.devices.values():
            device.set_tenants(policies)

    def alive(self) -> bool:
        return any(d.alive() for d in self.devices.values())

    @property
    def failure(self) -> str | None:
        """Why the engines stopped for good: only when every device's has (a dead worker restarts)."""
        failures = [d.failure for d in self.devices.values()]
        return failures[0] if all(failures) else None

    @property
    def last_tick_s(self) -> float:
        ticks = [d.last_tick_s for d in self.devices.values() if d.alive()]
        return max(ticks, default=time.monotonic())

    def stalled(self, stall_s: float) -> list[str]:
        """Devices whose engine runs but whose loop has been silent for `stall_s` seconds."""
        now_s = time.monotonic()
        return [name for name, d in self.devices.items() if d.alive() and now_s - d.last_tick_s >= stall_s]
