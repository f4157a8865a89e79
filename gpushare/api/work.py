"""A request's heavy work off the event loop: a bounded thread pool, each request under one budget.

Parsing a body, checking JSON Schemas, rendering a chat template and tokenising run here, never on
the HTTP event loop that every stream and /health share. The pool has WORK_THREADS threads and
holds at most MAX_PENDING jobs (beyond: 503, the node is busy). A request's jobs together may run
for `limits.work_timeout` (waiting for admission or a model load does not count): past it the
request gets 400 naming the limit, or 503 when its job never got a thread. A thread cannot be
stopped, so what runs here is bounded before it starts by the other limits (body bytes and JSON
items, schema characters, prompt characters); a chat template, which no bound on its input
bounds, renders in a process that is killed at the deadline or when the client leaves
(api/template_runner.py reads ``WorkBudget``).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from aiohttp import web

from gpushare.api.errors import ApiError
from gpushare.api.limits import limits_of

WORK_THREADS = 4  # pure-Python jobs share the GIL with the loop anyway: more threads would not go faster
MAX_PENDING = 64  # jobs queued or running; a burst beyond waits in clients, not in daemon memory
_BUDGET = "gpushare.work_budget"  # request key
_executor = ThreadPoolExecutor(WORK_THREADS, thread_name_prefix="gpushare-work")
_slots = threading.BoundedSemaphore(MAX_PENDING)


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
    """The request's budget."""
    budget = request.get(_BUDGET)
    if budget is None:
        limits = limits_of(request)
        # A template writes the messages (max_prompt_chars) with its markup, and may list the tools' schemas.
        budget = request[_BUDGET] = WorkBudget(limits.work_timeout_s,
                                               2 * limits.max_prompt_chars + limits.max_schema_chars)
    return budget


def busy() -> ApiError:
    return ApiError(503, f"the daemon is busy preparing {MAX_PENDING} other requests; retry", retry_after_s=1)


async def bounded(request: web.Request, what: str, fn, *args):
    """``fn(*args)`` in the pool, within the request's budget; ``what`` names the work in the 400 of a
    timeout. A client that leaves (its handler cancelled) marks the budget cancelled for ``fn``."""
    budget = budget_of(request)
    if budget.spent_s >= budget.timeout_s:
        raise budget.over(what)
    if not _slots.acquire(blocking=False):
        raise busy()
    started = threading.Event()

    def job():
        started.set()
        return fn(*args)

    try:
        done = _executor.submit(job)
    except BaseException:
        _slots.release()
        raise
    done.add_done_callback(lambda _: _slots.release())  # run, failed or cancelled before it started
    began = budget.start_job()
    try:
        return await asyncio.wait_for(asyncio.wrap_future(done), budget.left_s())
    except asyncio.TimeoutError:
        budget.cancelled.set()  # what still runs of it stops where it can (a template render: its child is killed)
        raise (budget.over(what) if started.is_set() else busy()) from None
    except WorkStopped as e:
        raise budget.over(f"{what} ({e})") from None
    except asyncio.CancelledError:
        budget.cancelled.set()  # the client left: a template render stops now, not at its deadline
        raise
    finally:
        budget.end_job(began)
