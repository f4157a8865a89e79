"""The blocking work of getting models onto the node (hashing an uploaded blob or a pulled Hugging
Face file), run where the engines do not feel it: threads at the lowest scheduling priority (run_low).
A pull's downloads run in a process of their own instead (pull_child.py).

Hashing an uploaded blob or a pulled file (SHA-256 of gigabytes) takes CPU time; on a
node whose engine workers keep every core busy, that work at the normal priority takes time slices
from the engines' threads, which wait for each other at every step, so a pull would slow the models
already serving (issue 35). At nice 19 the scheduler gives those threads the cores only when the
engines leave them. Linux's nice is per thread, so the
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
