"""The engine's tenant accounting: KV bytes held, tokens computed and the fair-share counters, per
tenant across every model (policies: protocol/tenant_policy.py)."""

from dataclasses import dataclass, field

from gpushare.protocol.tenant_policy import PRIORITIES, TenantPolicy


@dataclass
class TenantLedger:
    """Shared by every model's pool and scheduler; touched only on the engine thread."""

    policies: dict[str, TenantPolicy] = field(default_factory=dict)
    used_bytes: dict[str, int] = field(default_factory=dict)
    virtual_tokens: dict[str, float] = field(default_factory=dict)
    computed_tokens: dict[str, int] = field(default_factory=dict)
    generated_tokens: dict[str, int] = field(default_factory=dict)
    prefix_hit_tokens: dict[str, int] = field(default_factory=dict)

    def policy(self, tenant: str) -> TenantPolicy:
        return self.policies.get(tenant) or TenantPolicy(tenant)

    def charge(self, tenant: str, delta_bytes: int) -> None:
        self.used_bytes[tenant] = self.used_bytes.get(tenant, 0) + delta_bytes

    def room_bytes(self, tenant: str, bytes_per_token: int) -> int | None:
        """Bytes the tenant may still take before its limit; None when unlimited."""
        limit = self.policy(tenant).limit_bytes(bytes_per_token)
        return None if limit is None else limit - self.used_bytes.get(tenant, 0)

    def count_computed(self, tenant: str, tokens: int) -> None:
        self.computed_tokens[tenant] = self.computed_tokens.get(tenant, 0) + tokens
        self.virtual_tokens[tenant] = self.virtual_tokens.get(tenant, 0.0) + tokens / self.policy(tenant).weight

    def activate(self, tenant: str, active: set) -> None:
        """A tenant with no work that comes back starts at the smallest active counter, not below:
        idle time is not credit to spend later (as in VTC)."""
        others = [self.virtual_tokens.get(t, 0.0) for t in active if t != tenant]
        if others:
            self.virtual_tokens[tenant] = max(self.virtual_tokens.get(tenant, 0.0), min(others))

    def admission_key(self, tenant: str, priority: str | None = None):
        """`priority`: the request's own (a trusted gateway's objective); None: the tenant's."""
        return (PRIORITIES.index(priority or self.policy(tenant).priority), self.virtual_tokens.get(tenant, 0.0))

    def urgent_tenants(self, waiting: set[tuple[str, str | None]],
                       running: set[tuple[str, str | None]]) -> set[tuple[str, str | None]]:
        """(tenant, request priority) pairs with waiting prompts that go ahead of the running work, in
        a step of their own: those of a higher priority than every other tenant's running sequences,
        and those of the same priority whose tenant has nothing running and no more than its fair
        share so far (a tenant already running is being served; its new prompts join the batch).
        A priority None is the tenant's own."""
        keys = {c: self.admission_key(*c) for c in waiting | running}
        running_tenants = {tenant for tenant, _ in running}
        urgent = set()
        for cls in waiting:
            others = [keys[c] for c in running if c[0] != cls[0]]
            if not others:
                continue
            first = min(others)
            if keys[cls][0] < first[0] or (cls[0] not in running_tenants and keys[cls] <= first):
                urgent.add(cls)
        return urgent
