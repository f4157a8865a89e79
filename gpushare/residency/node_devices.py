"""Every device's engine seen as one, for what is node-wide: merged snapshots (per-model and
per-tenant stats, for /api/ps, /metrics and the status line), tenant policies sent to every
engine, liveness. Requests never go through here: they go to the device their model is on
(``Lease.device``).

A tenant's kv_limit is node-wide: each engine enforces it on its own device, so each is given
the limit less what the tenant holds on the other devices, as their latest snapshots say
(``balance_kv_limits``, every BALANCE_INTERVAL_S). Between two rounds a tenant can exceed its
limit by what it grew meanwhile on two devices at once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from gpushare.protocol.engine_stats import EngineStats
from gpushare.protocol.tenant_policy import TenantPolicy, TenantStats

BALANCE_INTERVAL_S = 0.1
_SUMMED_TENANT_FIELDS = ("kv_used_bytes", "running", "waiting", "computed_tokens", "generated_tokens",
                         "prefix_hit_tokens")


class NodeDevices:
    def __init__(self, devices: dict):
        self.devices = devices  # name -> device (protocol/device.py)
        self.tenant_policies: dict[str, TenantPolicy] = {}
        self._sent: dict[str, list[TenantPolicy]] = {}  # what each device's engine was last given

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
        """The node's tenant policies; each engine gets them with its share of the kv_limits."""
        self.tenant_policies = {p.name: p for p in policies}
        self._sent = {}
        self.balance_kv_limits()

    def balance_kv_limits(self) -> None:
        """Give each engine the tenants' kv_limits less what each tenant holds on the other devices
        (sent only when that changed)."""
        used = {name: {t: s.kv_used_bytes for t, s in d.tenant_stats().items()} for name, d in self.devices.items()}
        for name, device in self.devices.items():
            elsewhere_bytes = {t: sum(u.get(t, 0) for other, u in used.items() if other != name)
                               for t in self.tenant_policies}
            stats = device.stats()
            policies = [device_share(p, elsewhere_bytes[p.name], stats) for p in self.tenant_policies.values()]
            if self._sent.get(name) != policies:
                self._sent[name] = policies
                device.set_tenants(policies)

    async def balance_forever(self) -> None:
        while True:
            await asyncio.sleep(BALANCE_INTERVAL_S)
            limited = [p for p in self.tenant_policies.values()
                       if p.kv_limit_bytes is not None or p.kv_limit_tokens is not None]
            if limited and len(self.devices) > 1:
                self.balance_kv_limits()

    def resend(self, name: str) -> None:
        """A restarted engine has no policies: send its share again."""
        self._sent.pop(name, None)
        self.balance_kv_limits()

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


def device_share(policy: TenantPolicy, elsewhere_bytes: int, stats: EngineStats) -> TenantPolicy:
    """`policy` for one device where the tenant holds `elsewhere_bytes` on the others: its kv_limit
    less that (token limits less it in tokens of the device's largest model per token)."""
    if not elsewhere_bytes or (policy.kv_limit_bytes is None and policy.kv_limit_tokens is None):
        return policy
    bytes_per_token = max((m.block_bytes // m.block_size for m in stats.models.values() if m.block_size), default=0)
    limit_bytes = None if policy.kv_limit_bytes is None else max(0, policy.kv_limit_bytes - elsewhere_bytes)
    limit_tokens = policy.kv_limit_tokens
    if limit_tokens is not None and bytes_per_token:
        limit_tokens = max(0, limit_tokens - -(-elsewhere_bytes // bytes_per_token))
    return replace(policy, kv_limit_bytes=limit_bytes, kv_limit_tokens=limit_tokens)
