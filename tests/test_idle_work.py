"""A request's bulk work in the engine's idle time (api/idle_work.py): the results of every piece in
order, computed on a SCHED_IDLE thread, and by the caller itself when that thread gets no time."""

import os
import sys
import threading

import pytest

from gpushare.api.idle_work import in_idle_time


def sched_idle_allowed() -> bool:
    """Whether a thread here may move itself to SCHED_IDLE (a seccomp profile can refuse it; the
    daemon then logs that bulk work runs at the usual priority)."""
    allowed = []

    def probe():
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            allowed.append(True)
        except OSError:
            allowed.append(False)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return allowed[0]


def test_pieces_come_back_in_order_from_an_idle_priority_thread():
    policies, threads = set(), set()

    def encode(piece):
        policies.add(os.sched_getscheduler(0) if sys.platform == "linux" else None)
        threads.add(threading.current_thread().name)
        return [x * x for x in piece]

    items = list(range(100))
    assert in_idle_time(items, encode, piece=7, patience_s=30) == [x * x for x in items]
    assert threads and all(name.startswith("gpushare-idle") for name in threads)
    if sys.platform == "linux" and sched_idle_allowed():
        assert policies == {os.SCHED_IDLE}


def test_the_caller_does_the_pieces_a_starved_idle_thread_has_not():
    release = threading.Event()
    by_caller = []

    def encode(piece):
        if threading.current_thread().name.startswith("gpushare-idle"):
            release.wait(30)  # as a thread that gets no CPU time
        else:
            by_caller.append(piece[0])
        return [str(x) for x in piece]

    try:
        items = list(range(10))
        assert in_idle_time(items, encode, piece=4, patience_s=0.2) == [str(x) for x in items]
        assert by_caller == [0, 4, 8]  # the idle thread's piece in flight too
    finally:
        release.set()


def test_an_error_in_a_piece_reaches_the_caller():
    def encode(piece):
        raise ValueError(f"bad piece {piece}")

    with pytest.raises(ValueError, match=r"bad piece \[0, 1\]"):
        in_idle_time([0, 1, 2], encode, piece=2, patience_s=30)
