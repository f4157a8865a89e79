"""The engine's tenant accounting: KV bytes held, tokens computed and the fair-share counters, per
tenant across every model (policies: protocol/tenant_policy.py)."""

from dataclasses import dataclass, field

from gpushare.protocol.tenant_policy import PRIORITIES, TenantPolicy

GROUP_SEPARATOR = "\x1f"  # in a fair-share key "tenant<US>group": no printable tenant name holds it


def group_key(tenant: str, fair_group: str) -> str:
    """The fair-share counter of a group inside a tenant (a trusted gateway's fairness id), or the tenant's."""
    return f"{tenant}{GROUP_SEPARATOR}{fair_group}" if fair_group else tenant


def tenant_of_key(key: str) -> str:
    return key.partition(GROUP_SEPARATOR)[0]


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
        """The tenant's policy; for a fair-share group's key (group_key), its tenant's."""
        name = tenant_of_key(tenant)
        return self.policies.get(name) or TenantPolicy(name)

    def charge(self, tenant: str, delta_bytes: int) -> None:
        self.used_bytes[tenant] = self.used_bytes.get(tenant, 0) + delta_bytes

    def room_bytes(self, tenant: str, bytes_per_token: int) -> int | None:
        """Bytes the tenant may still take before its limit; None when unlimited."""
        limit = self.policy(tenant).limit_bytes(bytes_per_token)
        return None if limit is None else limit - self.used_bytes.get(tenant, 0)

    def count_computed(self, tenant: str, tokens: int, fair_key: str | None = None) -> None:
        """``fair_key``: the fair-share counter that grows (a group's inside the tenant); None: the tenant's."""
        self.computed_tokens[tenant] = self.computed_tokens.get(tenant, 0) + tokens
        key = fair_key or tenant
        self.virtual_tokens[key] = self.virtual_tokens.get(key, 0.0) + tokens / self.policy(tenant).weight

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
