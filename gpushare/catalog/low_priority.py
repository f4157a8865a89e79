"""The CPU work of getting models onto the node, run where the engines do not feel it: threads at
the lowest scheduling priority, for blocking calls (run_low) and for coroutines on an event loop
of their own (run_low_loop).

A pull hashes gigabytes (SHA-256 of every blob) and may download through a library's blocking
client (Hugging Face's); on a node whose engine workers keep every core busy, that work at the
normal priority takes time slices from the engines' threads, which wait for each other at every
step, so a pull would slow the models already serving (issue 35). At nice 19 the scheduler gives
those threads the cores only when the engines leave them. Linux's nice is per thread, so the
pool's threads lower their own once, at start, and never raise it again (that would need root).
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor

LOWEST_NICE = 19
THREADS = 4  # a few pulls at once; more wait their turn

_pool: ThreadPoolExecutor | None = None


def _lower_own_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_NICE)
    except (AttributeError, OSError):  # not Linux, or refused: the work runs, at the normal priority
        pass


def _the_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(THREADS, thread_name_prefix="gpushare-low", initializer=_lower_own_priority)
    return _pool


async def run_low(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a lowest-priority thread, awaited."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_the_pool(), lambda: fn(*args, **kwargs))


async def run_low_loop(make_coroutine):
    """Await ``make_coroutine()`` run to its end on a new event loop in a lowest-priority thread.

    A blob's gigabytes then never pass through the caller's loop, which answers the API: each
    received chunk costs a wake-up, a copy and a write, and at the normal priority those took turns
    with the requests whose first token waits on that loop. Cancelling the awaiting task cancels
    the coroutine in its thread and waits for it to finish (its files closed) before raising."""
    started = threading.Event()
    running: dict = {}

    def run():
        loop = asyncio.new_event_loop()
        running["loop"], running["task"] = loop, loop.create_task(make_coroutine())
        started.set()
        try:
            return loop.run_until_complete(running["task"])
        finally:
            loop.close()

    done = _the_pool().submit(run)
    try:
        return await asyncio.shield(asyncio.wrap_future(done))
    except asyncio.CancelledError:
        if done.cancel():  # still queued behind other low-priority work: it never starts
            raise
        started.wait()  # it is running: at most the moment until its task exists
        try:
            running["loop"].call_soon_threadsafe(running["task"].cancel)
        except RuntimeError:  # it had just finished and closed its loop
            pass
        await asyncio.wait([asyncio.wrap_future(done)])
        raise
