"""A tenant's policy as the engine applies it (``TenantPolicy``: KV amounts, share weight, priority)
and what the engine reports of its use (``TenantStats``); the engine's own accounting is
engine/tenant_ledger.py.

A tenant's KV use is the bytes of the blocks its sequences hold, summed over every model.
``kv_limit`` caps it; ``kv_reserved`` is kept aside in the device KV pool: no other tenant may
take the part of it the tenant does not use, whatever model either sends its requests to.
Token quantities (``*_tokens``) are turned into bytes with the bytes-per-token of the model.
Fair share follows the VTC idea: each tenant's counter grows by the tokens computed for it divided
by its weight, and waiting requests of the tenant with the smallest counter are admitted first.
"""

from dataclasses import dataclass

PRIORITIES = ("interactive", "batch")
DEFAULT_TENANT = "default"


@dataclass
class TenantPolicy:
    name: str
    kv_reserved_bytes: int = 0
    kv_reserved_tokens: int = 0
    kv_limit_bytes: int | None = None
    kv_limit_tokens: int | None = None
    weight: float = 1.0
    priority: str = "interactive"

    def __post_init__(self):
        if self.priority not in PRIORITIES:
            raise ValueError(f"tenant {self.name}: priority must be one of {PRIORITIES}, got {self.priority!r}")
        if not self.weight > 0:
            raise ValueError(f"tenant {self.name}: weight must be > 0, got {self.weight!r}")

    def reserved_bytes(self, bytes_per_token: int) -> int:
        return max(self.kv_reserved_bytes, self.kv_reserved_tokens * bytes_per_token)

    def limit_bytes(self, bytes_per_token: int) -> int | None:
        limits = [x for x in (self.kv_limit_bytes,
                              None if self.kv_limit_tokens is None else self.kv_limit_tokens * bytes_per_token)
                  if x is not None]
        return min(limits) if limits else None


@dataclass
class TenantStats:
    kv_used_bytes: int = 0
    kv_reserved_bytes: int = 0
    kv_limit_bytes: int | None = None
    running: int = 0
    waiting: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    prefix_hit_tokens: int = 0
