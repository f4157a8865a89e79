"""Torch work off the engine thread (loads, unloads, the warm tier) runs in threads that end.

torch's CPU ops run their parallel regions on OpenMP, and libgomp keeps a team of worker
threads for every thread that ever ran one, for that thread's whole life. Once the teams hold
more threads than the machine has CPUs, libgomp stops letting idle workers spin: every parallel
region of the engine then pays a futex wake-up. Measured on a 2-core machine with the int8
SmolLM2: a batch-1 decode step took 24.6 ms on an engine thread while the thread that had
loaded the model lived on (a pool's worker, or the main thread), and 11.7 ms once that thread
had ended. So a load runs in a thread of its own that ends with it, and its team with it.
"""

import threading
from concurrent.futures import Future


def in_passing_thread(fn, *args, after: Future | None = None, name: str = "gpushare-load") -> Future:
    """Run ``fn(*args)`` in a new thread that ends when it returns; ``after``: first wait for that
    earlier job (jobs chained so keep their order). The future holds the result or the error."""
    future: Future = Future()

    def run() -> None:
        if after is not None:
            try:
                after.exception()
            except BaseException:  # a cancelled earlier job does not stop this one
                pass
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


class PassingThreads:
    """Jobs run one after another, in submission order, each in a thread that ends with it."""

    def __init__(self, name: str):
        self.name = name
        self._last: Future | None = None
        self._lock = threading.Lock()

    def submit(self, fn, *args) -> Future:
        with self._lock:
            self._last = in_passing_thread(fn, *args, after=self._last, name=self.name)
            return self._last


def timed_read(fn, args: tuple, timeout_s: float, why: str, then) -> None:
    """Run ``fn(*args)`` in a passing thread of its own and call ``then(future)`` once, in whichever comes
    first: its end, or ``timeout_s`` (the future then holds ``TimeoutError(why)`` and what ``fn`` returns
    later is dropped). For reads of files a stranger wrote, which may never end."""
    answered = threading.Lock()
    timer = None

    def once(future: Future) -> None:
        if answered.acquire(blocking=False):
            if timer is not None:
                timer.cancel()
            then(future)

    def give_up() -> None:
        late: Future = Future()
        late.set_exception(TimeoutError(why))
        once(late)

    timer = threading.Timer(timeout_s, give_up)
    timer.daemon = True
    timer.start()
    in_passing_thread(fn, *args, name="gpushare-read").add_done_callback(once)
