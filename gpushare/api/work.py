"""A request's heavy work off the event loop: a bounded thread pool, each request under one budget.

Parsing a body, checking JSON Schemas, rendering a chat template and tokenising run here, never on
the HTTP event loop that every stream and /health share. The pool runs WORK_THREADS jobs at once;
a job that finds them busy waits its turn in the ``WorkQueue`` (fair across priorities and tenants),
which holds at most `server.max_queued` waiting jobs (beyond: 503 with Retry-After). A request's
jobs together, waiting included, may take `limits.work_timeout` (waiting for admission or a model
load does not count): past it the request gets 400 naming the limit, or 503 when its job never got
a thread. A thread cannot be stopped, so what runs here is bounded before it starts by the other
limits (body bytes and JSON items, schema characters, prompt characters); a chat template, which no
bound on its input bounds, renders in a process that is killed at the deadline or when the client
leaves (api/template_runner.py reads ``WorkBudget``). The bodies held meanwhile are bounded node-wide
by `server.max_body_bytes_held` (``BodyBytes``).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

from aiohttp import web

from gpushare.api.context import context
from gpushare.api.errors import ApiError
from gpushare.api.limits import limits_of
from gpushare.api.tenants import TENANT, gate_of
from gpushare.protocol.tenant_policy import PRIORITIES

WORK_THREADS = 4  # pure-Python jobs share the GIL with the loop anyway: more threads would not go faster
_BUDGET = "gpushare.work_budget"  # request key
_executor = ThreadPoolExecutor(WORK_THREADS, thread_name_prefix="gpushare-work")
_arrivals = itertools.count()  # ties of equal arrival times, in the order they came


class WorkStopped(Exception):
    """A job gave up because its request's budget ended (the deadline passed, or the client left);
    the message names what it was doing."""


@dataclass
class WorkBudget:
    """One request's time for its work before the engine (its jobs' run times together; waiting for
    admission or a model load does not count), and whether its client has left."""
    timeout_s: float
    max_template_chars: int  # the most a chat template may write for it
    spent_s: float = 0.0  # by its jobs that have ended
    deadline: float = math.inf  # of the job running now (time.monotonic())
    cancelled: threading.Event = field(default_factory=threading.Event)
    rank: int = 0  # its priority's place in PRIORITIES: lower waits less
    fair_key: tuple = ()  # (tenant, fair-share group): whose turn it takes in the queue
    arrival: tuple = ()  # (time.monotonic(), n) of its first job: a tenant's requests go in this order

    @classmethod
    def starting_now(cls, timeout_s: float, max_template_chars: int) -> WorkBudget:
        budget = cls(timeout_s, max_template_chars)
        budget.start_job()
        return budget

    def start_job(self) -> float:
        started = time.monotonic()
        self.deadline = started + self.timeout_s - self.spent_s
        return started

    def end_job(self, started: float) -> None:
        self.spent_s += time.monotonic() - started

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def over(self, what: str) -> ApiError:
        return ApiError(400, f"{what} took longer than the limit of {self.timeout_s:g}s (limits.work_timeout)",
                        code="work_timeout")


def budget_of(request: web.Request) -> WorkBudget:
    """The request's budget, and its place in the work queue (its priority, its tenant's turn)."""
    budget = request.get(_BUDGET)
    if budget is None:
        limits = limits_of(request)
        # A template writes the messages (max_prompt_chars) with its markup, and may list the tools' schemas.
        budget = request[_BUDGET] = WorkBudget(limits.work_timeout_s,
                                               2 * limits.max_prompt_chars + limits.max_schema_chars)
        state = request.get(TENANT) or gate_of(request).default  # the open paths name no tenant
        route = gate_of(request).gateway.route(request.headers, state.name,
                                               context(request).settings.server.trust_gateway_headers)
        budget.rank = PRIORITIES.index(route.priority or state.settings.priority)
        budget.fair_key = (state.name, route.fair_group)
        budget.arrival = (time.monotonic(), next(_arrivals))
    return budget


class WorkQueue:
    """Turns at the pool's threads. A job runs at once when a thread is free and nothing waits; else it
    waits: the first priority (PRIORITIES order) first, within one priority a turn for each tenant (or
    gateway fair-share group) in rotation, and a tenant's own jobs by their requests' arrival, so a
    request that came first is prepared first (its next job does not queue behind a burst's first
    ones). Lives on the event loop; ``release`` is called there when a job's thread is free."""

    def __init__(self, threads: int):
        self.threads = threads
        self.running = 0
        self.queued = 0
        self._waiting: list[OrderedDict] = [OrderedDict() for _ in PRIORITIES]  # fair key -> heap of waiters

    async def turn(self, budget: WorkBudget, max_queued: int) -> None:
        """Returns holding a thread (``release`` gives it back); 503 past ``max_queued`` waiting jobs or
        when the budget ends first."""
        if self.running < self.threads and not self.queued:
            self.running += 1
            return
        if self.queued >= max_queued:
            raise busy(f"{self.queued} requests wait for their preparation, the most it queues "
                       f"(server.max_queued)")
        waiter = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting[budget.rank].setdefault(budget.fair_key, []),
                       (budget.arrival, next(_arrivals), waiter))
        self.queued += 1
        try:
            await asyncio.wait_for(waiter, max(0.0, budget.left_s()))
        except BaseException as e:  # its time ended, or the client left, while it waited
            # Handed a thread just now (wait_for can time out after the result was set): hand it on.
            if waiter.done() and not waiter.cancelled():
                self.release()
            else:
                self._forget(budget, waiter)
            if isinstance(e, asyncio.TimeoutError):
                raise busy(f"this request waited {budget.timeout_s:g}s for its preparation, its limit "
                           f"(limits.work_timeout)") from None
            raise

    def release(self) -> None:
        self.running -= 1
        while self.running < self.threads and self.queued:
            waiter = self._next()
            if not waiter.done():
                self.running += 1
                waiter.set_result(None)

    def _next(self) -> asyncio.Future:
        for tenants in self._waiting:
            if tenants:
                key, heap = next(iter(tenants.items()))
                waiter = heapq.heappop(heap)[2]
                if heap:
                    tenants.move_to_end(key)
                else:
                    del tenants[key]
                self.queued -= 1
                return waiter
        raise AssertionError("queued counts a waiter that is not there")

    def _forget(self, budget: WorkBudget, waiter: asyncio.Future) -> None:
        heap = self._waiting[budget.rank].get(budget.fair_key, [])
        for i, item in enumerate(heap):
            if item[2] is waiter:
                heap[i] = heap[-1]
                heap.pop()
                heapq.heapify(heap)
                self.queued -= 1
                if not heap:
                    del self._waiting[budget.rank][budget.fair_key]
                return


_queue = WorkQueue(WORK_THREADS)


def work_queue() -> WorkQueue:
    """The pool's queue, as /metrics shows it."""
    return _queue


def busy(why: str) -> ApiError:
    return ApiError(503, f"the daemon is busy: {why}; retry", code="work_queue_full", retry_after_s=1)


async def bounded(request: web.Request, what: str, fn, *args):
    """``fn(*args)`` in the pool, within the request's budget; ``what`` names the work in the 400 of a
    timeout. A client that leaves (its handler cancelled) marks the budget cancelled for ``fn``."""
    budget = budget_of(request)
    if budget.spent_s >= budget.timeout_s:
        raise budget.over(what)
    began = budget.start_job()  # the wait for a thread counts: a queue that does not move ends in a 503
    try:
        await _queue.turn(budget, context(request).settings.server.max_queued)
    except BaseException:
        budget.end_job(began)
        raise
    loop = asyncio.get_running_loop()
    try:
        done = _executor.submit(fn, *args)
    except BaseException:
        _queue.release()
        budget.end_job(began)
        raise
    done.add_done_callback(lambda _: _on_loop(loop, _queue.release))  # its thread is free
    try:
        return await asyncio.wait_for(asyncio.wrap_future(done), budget.left_s())
    except asyncio.TimeoutError:
        budget.cancelled.set()  # what still runs of it stops where it can (a template render: its child is killed)
        raise budget.over(what) from None
    except WorkStopped as e:
        raise budget.over(f"{what} ({e})") from None
    except asyncio.CancelledError:
        budget.cancelled.set()  # the client left: a template render stops now, not at its deadline
        raise
    finally:
        budget.end_job(began)


def _on_loop(loop: asyncio.AbstractEventLoop, fn) -> None:
    try:
        loop.call_soon_threadsafe(fn)
    except RuntimeError:  # the loop has closed (the daemon stopped while the job ran): nothing waits
        pass


class BodyBytes:
    """The bytes of request bodies the node holds, read and not yet parsed, against
    `server.max_body_bytes_held`: a burst of big bodies waits in its clients, not in this process's
    memory. Lives on the event loop."""

    def __init__(self) -> None:
        self.held = 0

    def take(self, size: int, limit_bytes: int) -> None:
        """Hold ``size`` more bytes, or 413 (one body over the whole bound) / 503 (the node holds too many)."""
        if size > limit_bytes:
            raise ApiError(413, f"request body is larger than the {limit_bytes} bytes of bodies the node holds at "
                                f"once (server.max_body_bytes_held)")
        if self.held + size > limit_bytes:
            raise ApiError(503, f"the daemon is busy: it holds {self.held} bytes of request bodies, and this one "
                                f"would pass the limit of {limit_bytes} (server.max_body_bytes_held); retry",
                           code="body_bytes_full", retry_after_s=1)
        self.held += size

    @contextmanager
    def holding(self):
        """Counts what ``take`` takes in the block; all of it is given back on leaving."""
        taken = [0]

        def take(size: int, limit_bytes: int) -> None:
            self.take(size, limit_bytes)
            taken[0] += size

        try:
            yield take
        finally:
            self.held -= taken[0]


body_bytes = BodyBytes()
