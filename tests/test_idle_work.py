"""A large request's tokenising in the engine's idle time (api/idle_work.py): the ids the request's own
thread would make, from a child process at SCHED_IDLE, kept for the next request; the caller's own
when that child gets no time, fails or has exited."""

import logging
import os
import signal
import sys
import threading
import time

import psutil
import pytest
from encoder_models import DOCUMENTS, QUERY, TEXTS, bert_embedder

from gpushare.api.idle_work import in_idle_time
from gpushare.catalog.model_head import load_model_head
from gpushare.catalog.tokenise_child import tokenised

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="SCHED_IDLE and the signals are Linux's")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_model_head(str(bert_embedder(tmp_path_factory.mktemp("enc") / "bert-mini")), "float32").tokenizer


def tokenising_children() -> list[int]:
    """The live tokenising children of this process (psutil reads each process's parent: the kernel's
    per-thread children lists are exact only while the children are stopped)."""
    pids = []
    for child in psutil.Process().children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "gpushare.catalog.tokenise_child" in child.cmdline():
                pids.append(child.pid)
        except psutil.NoSuchProcess:  # ended meanwhile
            pass
    return pids


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def sched_idle_allowed() -> bool:
    """Whether a thread here may move itself to SCHED_IDLE (a seccomp profile can refuse it)."""
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


def flood(n: int) -> list[str]:
    return [f"{TEXTS[i % len(TEXTS)]} number {i}" for i in range(n)]


@pytest.mark.parametrize("op, items", [("inputs", flood(300)), ("pairs", [(QUERY, d) for d in DOCUMENTS * 20]),
                                       ("prompts", [(QUERY, d) for d in DOCUMENTS * 20])])
def test_a_flood_is_tokenised_by_an_idle_priority_child(tokenizer, op, items, caplog):
    caplog.set_level(logging.INFO, logger="gpushare.api.idle_work")
    expected = tokenised(tokenizer, op, items, 16)
    assert any(len(ids) == 16 for ids, _ in expected)  # some are cut
    assert in_idle_time(tokenizer, op, items, 16, piece=7, patience_s=30) == expected
    children = tokenising_children()
    assert children, "a child that answered is kept for the next request"
    assert "tokenising child failed" not in caplog.text
    if sched_idle_allowed():
        assert {os.sched_getscheduler(pid) for pid in children} == {os.SCHED_IDLE}


def test_the_caller_does_what_a_starved_child_has_not(tokenizer):
    items = flood(200)
    in_idle_time(tokenizer, "inputs", items[:50], 32, piece=8, patience_s=30)  # a child kept, idle
    stopped = tokenising_children()
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)  # as a process that gets no CPU time
    try:
        started = time.monotonic()
        assert in_idle_time(tokenizer, "inputs", items, 32, piece=8, patience_s=0.3) == \
            tokenised(tokenizer, "inputs", items, 32)
        assert time.monotonic() - started < 10
        assert set(tokenising_children()) < set(stopped), "the starved child was ended"
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def test_an_exited_child_is_replaced(tokenizer, caplog):
    caplog.set_level(logging.INFO, logger="gpushare.api.idle_work")
    items = flood(100)
    in_idle_time(tokenizer, "inputs", items, 32, piece=16, patience_s=30)
    killed = tokenising_children()
    assert killed
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not all(gone(pid) for pid in killed) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert in_idle_time(tokenizer, "inputs", items, 32, piece=16, patience_s=30) == \
        tokenised(tokenizer, "inputs", items, 32)
    assert tokenising_children(), "a new child took the work and was kept"
    assert "tokenising child failed" not in caplog.text  # the request did not fall back to its own thread


def test_an_error_in_the_child_reaches_the_caller_as_its_own(tokenizer, caplog):
    caplog.set_level(logging.INFO, logger="gpushare.api.idle_work")
    items = flood(40) + [None]  # not a text: the library refuses it, in the child and then in the caller
    with pytest.raises(TypeError):
        in_idle_time(tokenizer, "inputs", items, 32, piece=8, patience_s=30)
    assert "tokenising child failed" in caplog.text
