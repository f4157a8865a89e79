"""A request's bulk CPU work done in the time the engine leaves idle: one thread at Linux's SCHED_IDLE.

On a node whose cores all run an engine worker's threads, bulk work in the API process (tokenising
4,000 embedding inputs: ~120 ms of a core) takes cores from the workers' steps, at any pace: steps
that overlapped it took 2-3x as long, in pieces with three times their length idle between them
still up to 3x, and a stream's tokens came that much further apart. A SCHED_IDLE thread runs only on
a core that no other thread wants and never preempts one, so the steps keep their cores and the
work fills their gaps: 4,000 inputs in ~0.8 s beside one stream, 1-2 s beside 16 or 64.

The work goes in pieces, and the caller waits ``patience_s`` for the idle thread: past it (a machine
busy with other programs) the caller encodes the pieces still missing itself, at its own priority,
so a request never waits on idle time that does not come. Without the policy (not Linux) the thread
runs at the usual priority. The thread is made once and runs only this work: without CAP_SYS_NICE
a thread cannot leave SCHED_IDLE. What runs here should let go of Python's lock while it works (the
tokenizers library's batch calls do): a thread that waits for idle time while it holds the lock
holds up the event loop with it.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor, TimeoutError
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)


def _at_idle_priority() -> None:
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
    except (AttributeError, OSError) as e:
        log.info("bulk request work runs at the usual priority (no SCHED_IDLE here: %s)", e)


_idle_executor = ThreadPoolExecutor(1, thread_name_prefix="gpushare-idle", initializer=_at_idle_priority)


@dataclass
class _Pieces:
    items: list
    encode: Callable[[list], list]
    size: int
    results: list  # per piece: its encoded items, None until one of the two threads has done it
    abandoned: bool = False  # the caller took over: the idle thread stops

    def piece(self, k: int) -> list:
        return self.encode(self.items[k * self.size:(k + 1) * self.size])

    def run(self) -> None:
        for k in range(len(self.results)):
            if self.abandoned:
                return
            if self.results[k] is None:
                self.results[k] = self.piece(k)


def in_idle_time(items: list, encode: Callable[[list], list], piece: int, patience_s: float) -> list:
    """``encode(items[i:i + piece])`` for each piece in turn, concatenated, on the idle thread; what it
    has not done after ``patience_s`` the caller does (a piece both did comes out the same)."""
    pieces = _Pieces(items, encode, piece, [None] * -(-len(items) // piece))
    done = _idle_executor.submit(pieces.run)
    try:
        done.result(timeout=patience_s)
    except TimeoutError:
        pieces.abandoned = True
        for k, result in enumerate(pieces.results):  # the idle thread's piece in flight too: it may be starved
            if result is None:
                pieces.results[k] = pieces.piece(k)
    return [item for result in pieces.results for item in result]
