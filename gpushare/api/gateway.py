"""Trusted gateway headers: which tenant's fair share and which priority a request gets behind a
Gateway API Inference Extension gateway (docs/kubernetes.md).

Such a gateway passes two request headers on: ``x-gateway-inference-fairness-id`` (a group whose
requests share capacity fairly) and ``x-gateway-inference-objective`` (the name of an
InferenceObjective). With ``server.trust_gateway_headers`` the fairness id names a fair-share group
inside the key's tenant: the engine shares the tenant's turns fairly among its groups, as it does
among tenants. It never reaches another tenant: the tenant stays the key's for the allow-list, the
rate and concurrency limits, KV reservations and ceilings, and the prefix cache's scope (a header
naming another tenant is just a group of that name inside the key's own). The objective names the
request's priority (``interactive`` or ``batch``). Without the setting both headers are ignored.

A tenant has at most MAX_GROUPS_PER_TENANT groups (each keeps a counter in the engine) of at most
MAX_GROUP_CHARS characters; a further or longer id, like an unknown objective, keeps the tenant's
own and is logged once per name: a typo in a gateway's configuration shows in the journal without
flooding it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from gpushare.protocol.tenant_policy import PRIORITIES

FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
MAX_LOGGED_NAMES = 256  # distinct unknown names logged; a gateway sending endless new ones stops here
MAX_SHOWN_CHARS = 64  # of a header value in the log (it comes from the network)
MAX_GROUP_CHARS = 128  # of a fairness id
MAX_GROUPS_PER_TENANT = 256  # distinct fairness ids a tenant's requests may use

log = logging.getLogger("gpushare.api")


@dataclass
class GatewayRoute:
    """Where a request goes in the engine: a fair-share group inside its key's tenant, its priority."""
    fair_group: str = ""  # "": the tenant's own fair share
    priority: str | None = None  # None: the tenant's own


class GatewayHeaders:
    """Reads the trusted headers of requests; remembers the groups each tenant has used and the unknown
    names it has logged."""

    def __init__(self) -> None:
        self._logged: set[tuple[str, str]] = set()
        self._groups: dict[str, set[str]] = {}  # tenant -> fairness ids seen (at most MAX_GROUPS_PER_TENANT)

    def route(self, headers: Mapping[str, str], key_tenant: str, trusted: bool) -> GatewayRoute:
        """The route of a request whose API key belongs to `key_tenant`."""
        route = GatewayRoute()
        if not trusted:
            return route
        fairness_id = headers.get(FAIRNESS_HEADER, "").strip()
        if fairness_id:
            route.fair_group = self._group(key_tenant, fairness_id)
        objective = headers.get(OBJECTIVE_HEADER, "").strip()
        if objective in PRIORITIES:
            route.priority = objective
        elif objective:
            self._log_once(OBJECTIVE_HEADER, objective, f"names no priority ({', '.join(PRIORITIES)}); the "
                           f"tenant's own is used")
        return route

    def _group(self, tenant: str, fairness_id: str) -> str:
        """The fair-share group a fairness id names inside ``tenant``; "" (the tenant's own) for one that is
        too long or beyond the tenant's MAX_GROUPS_PER_TENANT (each group keeps a counter in the engine)."""
        groups = self._groups.setdefault(tenant, set())
        if fairness_id in groups:
            return fairness_id
        if len(fairness_id) > MAX_GROUP_CHARS or not fairness_id.isprintable():
            self._log_once(FAIRNESS_HEADER, fairness_id, f"is over {MAX_GROUP_CHARS} printable characters; "
                           f'scheduled as the tenant "{tenant}" itself')
            return ""
        if len(groups) >= MAX_GROUPS_PER_TENANT:
            self._log_once(FAIRNESS_HEADER, fairness_id, f'is one fairness group more than the tenant "{tenant}" '
                           f"may have ({MAX_GROUPS_PER_TENANT}); scheduled as the tenant itself")
            return ""
        groups.add(fairness_id)
        return fairness_id

    def _log_once(self, header: str, value: str, consequence: str) -> None:
        if (header, value) in self._logged or len(self._logged) >= MAX_LOGGED_NAMES:
            return
        self._logged.add((header, value))
        shown = value[:MAX_SHOWN_CHARS] + ("..." if len(value) > MAX_SHOWN_CHARS else "")
        log.warning("%s %r %s (logged once per name)", header, shown, consequence)
