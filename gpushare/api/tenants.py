"""Tenants at the HTTP edge: who is asking (API key), may they (models, limits), and what they may see.

With no `tenants:` configured every request is the keyless tenant "default", as with Ollama.
Otherwise each request but the probes and the status page's files (OPEN_PATHS) carries a tenant's key (`Authorization: Bearer
KEY` or `x-api-key: KEY`), compared as SHA-256 digests with hmac.compare_digest, or gets a 401.
A tenant sees and uses only the models its allow-list names, sees only its own /api/ps row
(an `admin` tenant sees every row), and only an admin may create, delete or unload models or
read /metrics (it names every tenant).
Admission (generations, embeddings, scores, loads, and what tokenises or reads a model's files without
generating: count_tokens, /api/show), in this order, answers at once:

- 403 for a model outside the tenant's `models` allow-list (names or fnmatch patterns);
- 429 over `requests_per_s` (a token bucket holding one second's worth, at least one);
- 429 when `max_concurrent` requests run and `max_queued` already wait; a queued request waits
  here, before the registry and the engine, until one of its tenant's requests ends;
- 429 over `tokens_per_min` (a bucket holding a minute's worth), charged prompt + max_tokens once
  the prompt is known and refunded the tokens the answer did not use. A request dearer than the
  whole bucket goes when the bucket is full and leaves it in debt, so it is slowed, never refused.

Every 429 carries Retry-After (seconds until that limit lets the request through; 1 for the
concurrency limits, which end when a request does) and names the limit in its message and code.
The node's own bound, 503 with Retry-After, stays the registry's. Ordering by priority, fair
share and KV quotas are the engine's (gpushare.protocol.tenant_policy), given by `set_tenants`.

Everything here runs on the event loop. `apply_tenant_settings` swaps the configuration live
(SIGHUP): requests already admitted keep their admission, and tenants that stay keep their
running count, queue and bucket levels (clamped to the new sizes).
"""

from __future__ import annotations

import asyncio
import fnmatch
import hashlib
import hmac
import math
import time
from collections import deque
from contextlib import asynccontextmanager

from aiohttp import web

from gpushare.api.context import CONTEXT, ApiContext, context
from gpushare.api.errors import ApiError
from gpushare.api.gateway import GatewayHeaders
from gpushare.api.ui import UI_PATHS
from gpushare.settings.settings import Settings, TenantSettings
from gpushare.residency.registry import ModelNotFound
from gpushare.protocol.tenant_policy import DEFAULT_TENANT, TenantPolicy

# Probes need no key, nor the status page's static files (they hold no data; api/ui.py).
OPEN_PATHS = frozenset({"/", "/api/version", "/health", "/ready", *UI_PATHS})
GATEWAY_METRICS_PATH = "/metrics/gateway"  # keyless with server.open_gateway_metrics (api/gateway_metrics.py)
INFERENCE_PATHS = frozenset({"/api/generate", "/api/chat", "/api/embed", "/api/embeddings", "/api/load",
                             "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/rerank", "/rerank",
                             "/v1/score", "/v1/messages", "/v1/responses"})
# Admitted as a generation is (allow-list, requests_per_s, max_concurrent): the inference paths and those
# that tokenise or read model files for a tenant without generating.
ADMITTED_PATHS = INFERENCE_PATHS | {"/v1/messages/count_tokens", "/api/show"}
TENANT = web.RequestKey("gpushare.tenant", object)  # the request's TenantState


def _retry_after(wait_s: float) -> int:
    return max(1, math.ceil(wait_s))


class TokenBucket:
    """`rate_per_s` tokens a second up to `capacity`; starts full. The level may go below zero."""

    def __init__(self, rate_per_s: float, capacity: float):
        self.rate_per_s = rate_per_s
        self.capacity = capacity
        self.level = capacity
        self.stamp_s = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.stamp_s) * self.rate_per_s)
        self.stamp_s = now

    def wait_s(self, amount: float) -> float:
        """Seconds until `amount` may be taken (0: now); more than the capacity needs a full bucket."""
        self._refill()
        return max(0.0, (min(amount, self.capacity) - self.level) / self.rate_per_s)

    def take(self, amount: float) -> None:
        self._refill()
        self.level -= amount

    def give(self, amount: float) -> None:
        self._refill()
        self.level = min(self.capacity, self.level + amount)

    def resize(self, rate_per_s: float, capacity: float) -> None:
        self._refill()
        self.rate_per_s, self.capacity = rate_per_s, capacity
        self.level = min(self.level, capacity)


def _resized(bucket: TokenBucket | None, rate_per_s: float | None, capacity: float) -> TokenBucket | None:
    if rate_per_s is None:
        return None
    if bucket is None:
        return TokenBucket(rate_per_s, capacity)
    bucket.resize(rate_per_s, capacity)
    return bucket


def too_many(message: str, limit: str, wait_s: float) -> ApiError:
    return ApiError(429, message, code=limit, retry_after_s=_retry_after(wait_s))


class TenantState:
    """One tenant's limits and live counters in the API: running slots, queue, rate buckets."""

    def __init__(self, settings: TenantSettings, default_max_queued: int):
        self.running = 0  # requests holding a slot: admitted, not yet ended
        self.waiters: deque[asyncio.Future] = deque()
        self.request_bucket: TokenBucket | None = None
        self.token_bucket: TokenBucket | None = None
        self.update(settings, default_max_queued)

    def update(self, settings: TenantSettings, default_max_queued: int) -> None:
        self.settings = settings
        self.name = settings.name
        self.max_queued = settings.max_queued if settings.max_queued is not None else default_max_queued
        rps, tpm = settings.requests_per_s, settings.tokens_per_min
        self.request_bucket = _resized(self.request_bucket, rps, max(1.0, rps or 0.0))
        self.token_bucket = _resized(self.token_bucket, None if tpm is None else tpm / 60.0, float(tpm or 0))
        self._hand_out_slots()

    def _has_slot(self) -> bool:
        limit = self.settings.max_concurrent
        return limit is None or self.running < limit

    def _hand_out_slots(self) -> None:
        """Give free slots to queued requests, first come first served."""
        while self.waiters and self._has_slot():
            waiter = self.waiters.popleft()
            if not waiter.done():
                self.running += 1
                waiter.set_result(None)

    def refusal(self) -> ApiError | None:
        """The 429 a new request would get now (over its rate, or no slot and a full queue), else None."""
        if self.request_bucket is not None:
            wait_s = self.request_bucket.wait_s(1)
            if wait_s > 0:
                return too_many(f'tenant "{self.name}" is over its rate limit of '
                                f"{self.settings.requests_per_s:g} requests per second (requests_per_s); "
                                f"retry in {_retry_after(wait_s)}s", "requests_per_s", wait_s)
        if (self.waiters or not self._has_slot()) and len(self.waiters) >= self.max_queued:
            limit = self.settings.max_concurrent
            if self.max_queued == 0:
                return too_many(f'tenant "{self.name}" is at its max_concurrent limit of {limit} running '
                                f"requests, with no queue (max_queued 0); retry when one ends", "max_concurrent", 1)
            return too_many(f'tenant "{self.name}" is at its max_queued limit of {self.max_queued} queued requests '
                            f"(beyond max_concurrent {limit} running); retry when one ends", "max_queued", 1)
        return None

    async def acquire(self) -> None:
        """Take a request slot: at once, after waiting in the queue, or a 429 that names the limit."""
        refused = self.refusal()
        if refused is not None:
            raise refused
        if not self.waiters and self._has_slot():
            self._take_request()
            self.running += 1
            return
        self._take_request()
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:  # the client left while queued
            if waiter.done() and not waiter.cancelled():  # a slot was handed over just now: give it on
                self.release()
            elif waiter in self.waiters:
                self.waiters.remove(waiter)
            raise

    def _take_request(self) -> None:
        if self.request_bucket is not None:
            self.request_bucket.take(1)

    def release(self) -> None:
        self.running -= 1
        self._hand_out_slots()

    def charge_tokens(self, tokens: int) -> None:
        """Take `tokens` from tokens_per_min, or a 429 saying when they will be there."""
        if self.token_bucket is None:
            return
        wait_s = self.token_bucket.wait_s(tokens)
        if wait_s > 0:
            raise too_many(f'tenant "{self.name}" is over its rate limit of {self.settings.tokens_per_min} tokens '
                           f"per minute (tokens_per_min): this request counts {tokens} (prompt + max_tokens); "
                           f"retry in {_retry_after(wait_s)}s", "tokens_per_min", wait_s)
        self.token_bucket.take(tokens)

    def refund_tokens(self, tokens: int) -> None:
        if self.token_bucket is not None and tokens > 0:
            self.token_bucket.give(tokens)

    def may_use(self, model_name: str) -> bool:
        patterns = self.settings.models
        return patterns is None or any(fnmatch.fnmatchcase(model_name, p) for p in patterns)


class Ticket:
    """A request's admission: its tenant (always the key's), the fair-share group inside it and the
    priority a trusted gateway named (api/gateway.py), and the tokens it was charged."""

    def __init__(self, state: TenantState):
        self.state = state
        self.tenant = state.name
        self.fair_group = ""  # "": the tenant's own fair share
        self.priority: str | None = None  # None: the engine tenant's own
        self.charged_tokens = 0
        self.timings = None  # gpushare.api.streaming.Timings: what the answer really used

    def charge_tokens(self, tokens: int, timings) -> None:
        self.state.charge_tokens(tokens)
        self.charged_tokens += tokens
        self.timings = timings

    def settle(self) -> None:
        if self.charged_tokens and self.timings is not None:
            used = self.timings.prompt_tokens + self.timings.generated_tokens
            self.state.refund_tokens(self.charged_tokens - used)


class TenantGate:
    """The configured tenants and their keys; `identify` maps a presented key to a TenantState."""

    def __init__(self) -> None:
        self.default = TenantState(TenantSettings(DEFAULT_TENANT), 0)
        self.states: dict[str, TenantState] = {}
        self._key_digests: list[tuple[bytes, str]] = []
        self.gateway = GatewayHeaders()

    @property
    def enabled(self) -> bool:
        return bool(self.states)

    def configure(self, settings: Settings) -> None:
        states = {}
        for t in settings.tenants:
            state = self.states.get(t.name)
            if state is None:
                state = TenantState(t, settings.server.max_queued)
            else:
                state.update(t, settings.server.max_queued)
            states[t.name] = state
        self.states = states
        self._key_digests = [(bytes.fromhex(d), t.name) for t in settings.tenants for d in t.api_key_sha256]

    def identify(self, key: str | None) -> TenantState:
        if not self.enabled:
            return self.default
        if not key:
            raise ApiError(401, "missing API key: send it as Authorization: Bearer <key>", code="missing_api_key")
        digest = hashlib.sha256(key.encode()).digest()
        owner = None
        for known, name in self._key_digests:  # every key compared, in constant time each
            if hmac.compare_digest(known, digest):
                owner = name
        if owner is None:
            raise ApiError(401, "invalid API key", code="invalid_api_key")
        return self.states[owner]


def presented_key(request: web.Request) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key", "").strip() or None


def gate_of(target: ApiContext | web.Application | web.Request) -> TenantGate:
    ctx = target.app[CONTEXT] if isinstance(target, web.Request) else \
        target[CONTEXT] if isinstance(target, web.Application) else target
    return ctx.tenants


@web.middleware
async def tenant_middleware(request: web.Request, handler):
    """Identify the tenant of every request but the open paths (401 when it cannot be)."""
    if request.path not in OPEN_PATHS and not _open_gateway_metrics(request):
        state = request[TENANT] = gate_of(request).identify(presented_key(request))
        if request.method == "POST" and request.path in ADMITTED_PATHS:
            # Refused before its body is read: a tenant's flood of 429s costs no body read or JSON
            # parse, work that competes with the engine for the GIL (acquire() checks again).
            refused = state.refusal()
            if refused is not None:
                raise refused
    return await handler(request)


def _open_gateway_metrics(request: web.Request) -> bool:
    return request.path == GATEWAY_METRICS_PATH and context(request).settings.server.open_gateway_metrics


def tenant_of(request: web.Request) -> TenantState:
    return request[TENANT]


def _canonical_name(request: web.Request, model: str) -> str:
    try:
        return context(request).registry.find(model).name
    except ModelNotFound:
        return model  # unknown: the allow-list decides first, so a 404 never tells a tenant what exists


def check_model(request: web.Request, model: str) -> None:
    """403 unless the request's tenant may use `model`."""
    state = tenant_of(request)
    if not state.may_use(_canonical_name(request, model)):
        raise ApiError(403, f'tenant "{state.name}" may not use model "{model}"', param="model",
                       code="model_not_allowed")


def is_admin(request: web.Request) -> bool:
    """No tenants configured (everyone is the operator), or the request's tenant is an admin."""
    return not gate_of(request).enabled or tenant_of(request).settings.admin


def check_admin(request: web.Request, action: str) -> None:
    """With tenants configured, only an admin tenant may change what the node serves for everyone."""
    if not is_admin(request):
        name = tenant_of(request).name
        raise ApiError(403, f'tenant "{name}" may not {action}: it needs admin: true', code="admin_only")


def check_keep_alive(request: web.Request, keep_alive_s: float | None) -> None:
    """keep_alive 0 unloads the model for every tenant, and a very short one nearly does, so with tenants
    only an admin may send one below server.min_keep_alive (negative, "for ever", is fine)."""
    if keep_alive_s == 0:
        check_admin(request, "unload models (keep_alive 0)")
    floor_s = context(request).settings.server.min_keep_alive_s
    if keep_alive_s is not None and 0 < keep_alive_s < floor_s:
        check_admin(request, f"set keep_alive below {floor_s:g}s (server.min_keep_alive)")


def visible(request: web.Request, names) -> list[str]:
    """The model names among `names` the request's tenant may use."""
    state = tenant_of(request)
    return [n for n in names if state.may_use(n)]


@asynccontextmanager
async def admit(request: web.Request, model: str):
    """Hold a slot of the request's tenant for one generation; yields its Ticket (see the module doc)."""
    check_model(request, model)
    state = tenant_of(request)
    await state.acquire()
    ticket = Ticket(state)
    gate = gate_of(request)
    route = gate.gateway.route(request.headers, state.name, context(request).settings.server.trust_gateway_headers)
    ticket.fair_group, ticket.priority = route.fair_group, route.priority
    try:
        yield ticket
    finally:
        ticket.settle()
        state.release()


def tenant_policies(settings: Settings) -> list[TenantPolicy]:
    return [TenantPolicy(t.name, kv_reserved_bytes=t.kv_reserved_bytes, kv_reserved_tokens=t.kv_reserved_tokens,
                         kv_limit_bytes=t.kv_limit_bytes, kv_limit_tokens=t.kv_limit_tokens, weight=t.weight,
                         priority=t.priority) for t in settings.tenants]


def apply_tenant_settings(target: ApiContext | web.Application, settings: Settings) -> None:
    """Make `settings.tenants` the live tenants of the API and the engine (call on the event loop)."""
    ctx = target[CONTEXT] if isinstance(target, web.Application) else target
    if ctx.tenants is None:
        ctx.tenants = TenantGate()
    ctx.node.set_tenants(tenant_policies(settings))
    ctx.tenants.configure(settings)
