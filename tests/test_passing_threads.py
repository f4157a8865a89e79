"""Loads run in threads that end: in order, errors kept, and no OpenMP team left behind."""

import subprocess
import sys
import threading
import time

import pytest

from gpushare.engine.passing_threads import PassingThreads


def test_jobs_run_in_order_each_in_a_thread_that_ends():
    jobs = PassingThreads("test-load")
    seen, threads = [], []

    def job(i):
        time.sleep(0.05 if i == 0 else 0)  # the first is the slowest: order must still hold
        seen.append(i)
        threads.append(threading.current_thread())
        return i * 10

    futures = [jobs.submit(job, i) for i in range(4)]
    assert [f.result(timeout=10) for f in futures] == [0, 10, 20, 30]
    assert seen == [0, 1, 2, 3]
    assert len(set(threads)) == 4 and all(t.name == "test-load" for t in threads)
    for t in threads:
        t.join(timeout=10)
        assert not t.is_alive()


def test_a_failed_job_keeps_its_error_and_the_next_one_still_runs():
    jobs = PassingThreads("test-load")

    def fail():
        raise ValueError("bad model file")

    failed = jobs.submit(fail)
    after = jobs.submit(lambda: "loaded")
    with pytest.raises(ValueError, match="bad model file"):
        failed.result(timeout=10)
    assert after.result(timeout=10) == "loaded"


def test_a_load_leaves_no_openmp_team_behind():
    """The reason for passing threads: a thread's OpenMP workers live as long as it does, and extra
    teams slow the engine's parallel regions (passing_threads.py). After a job that ran a parallel
    torch op, the process has as many threads as before it; a pool's thread would keep its team."""
    code = """
import os, time, torch
from concurrent.futures import ThreadPoolExecutor
from gpushare.engine.passing_threads import in_passing_thread

def parallel_op():
    torch.set_num_threads(2)
    torch.randn(4_000_000).exp_()
    return len(os.listdir("/proc/self/task"))

def settled():
    time.sleep(0.3)
    return len(os.listdir("/proc/self/task"))

in_passing_thread(parallel_op).result()  # the process's own one-off threads start here
before = settled()
during = in_passing_thread(parallel_op).result()
after = settled()
pool = ThreadPoolExecutor(1)
pool.submit(parallel_op).result()
print(before, during, after, settled())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    before, during, after, with_pool = map(int, out.stdout.split())
    assert during >= before + 2  # the job's thread and its OpenMP worker
    assert after == before
    assert with_pool >= before + 2  # what a thread pool would leave
