"""Trusted gateway headers: which tenant's fair share and which priority a request gets behind a
Gateway API Inference Extension gateway (docs/kubernetes.md).

Such a gateway passes two request headers on: ``x-gateway-inference-fairness-id`` (a group whose
requests share capacity fairly) and ``x-gateway-inference-objective`` (the name of an
InferenceObjective). With ``server.trust_gateway_headers`` the fairness id names the tenant whose
fair-share queue, KV accounting and priority the engine uses, and the objective names the request's
priority (``interactive`` or ``batch``). The API key still decides who may call at all: its own
tenant's allow-list and limits admit the request. Without the setting both headers are ignored,
since any caller could otherwise spend another tenant's share.

A name that matches nothing keeps the key's tenant (or the tenant's priority) and is logged once
per name: a typo in a gateway's configuration shows in the journal without flooding it.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from gpushare.protocol.tenant_policy import PRIORITIES

FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
MAX_LOGGED_NAMES = 256  # distinct unknown names logged; a gateway sending endless new ones stops here
MAX_SHOWN_CHARS = 64  # of a header value in the log (it comes from the network)

log = logging.getLogger("gpushare.api")


@dataclass
class GatewayRoute:
    """Where a request goes in the engine: the tenant it is scheduled and charged as, its priority."""
    tenant: str
    priority: str | None = None  # None: the tenant's own


class GatewayHeaders:
    """Reads the trusted headers of requests; remembers the unknown names it has logged."""

    def __init__(self) -> None:
        self._logged: set[tuple[str, str]] = set()

    def route(self, headers: Mapping[str, str], key_tenant: str, tenants: Collection[str],
              trusted: bool) -> GatewayRoute:
        """The route of a request whose API key belongs to `key_tenant`; `tenants`: the configured names."""
        route = GatewayRoute(key_tenant)
        if not trusted:
            return route
        fairness_id = headers.get(FAIRNESS_HEADER, "").strip()
        if fairness_id in tenants:
            route.tenant = fairness_id
        elif fairness_id:
            self._log_once(FAIRNESS_HEADER, fairness_id, f'names no tenant; scheduled as the key\'s tenant "{key_tenant}"')
        objective = headers.get(OBJECTIVE_HEADER, "").strip()
        if objective in PRIORITIES:
            route.priority = objective
        elif objective:
            self._log_once(OBJECTIVE_HEADER, objective, f"names no priority ({', '.join(PRIORITIES)}); the "
                           f"tenant's own is used")
        return route

    def _log_once(self, header: str, value: str, consequence: str) -> None:
        if (header, value) in self._logged or len(self._logged) >= MAX_LOGGED_NAMES:
            return
        self._logged.add((header, value))
        shown = value[:MAX_SHOWN_CHARS] + ("..." if len(value) > MAX_SHOWN_CHARS else "")
        log.warning("%s %r %s (logged once per name)", header, shown, consequence)
