"""A large request's tokenising done in the time the engine leaves idle: a child process at Linux's
SCHED_IDLE policy (gpushare/catalog/tokenise_child.py).

On a node whose cores all run an engine worker's threads, bulk work in the API process (tokenising
4,000 embedding inputs: ~120 ms of a core) takes cores from the workers' steps, at any pace: steps
that overlapped it took 2-3x as long, in pieces with three times their length idle between them
still up to 3x, and a stream's tokens came that much further apart. A SCHED_IDLE process runs only
on a core that no other thread wants and never preempts one, so the steps keep their cores and the
work fills their gaps: 4,000 inputs in ~0.8 s beside one stream, 1-2 s beside 16 or 64. It is a
process rather than a thread here because a starved thread that holds Python's lock holds the event
loop too (the child's docstring).

The child answers in pieces, and the caller waits ``patience_s`` for it: past it (a machine busy
with other programs) the child is killed and the caller tokenises the items still missing itself, at
its own priority, so a request never waits on idle time that does not come. So does a child that
fails or exits: the caller's own run then raises what the child met. Children are kept for the next
request, one per request at once (the work pool bounds how many), each started in ~0.2 s and sent
each model's tokenizer once.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import select
import subprocess
import sys
import time
import weakref

from gpushare.api.child_pool import ChildPool, kill
from gpushare.catalog.tokenise_child import HEADER_BYTES, framed, tokenised

log = logging.getLogger(__name__)

_children = ChildPool([sys.executable, "-m", "gpushare.catalog.tokenise_child"])
READ_BYTES = 1 << 20

_keys = itertools.count()
_pickled: dict[int, tuple[str, bytes]] = {}  # id(tokenizer) -> (its key, its pickle), while it lives


class _Late(Exception):
    """The child did not answer by the deadline (starved of idle time, or stopped)."""


def _tokenizer_message(tokenizer) -> tuple[str, bytes]:
    """(key, pickle) of a tokenizer, made once while it lives (a big vocabulary's takes tens of ms)."""
    known = _pickled.get(id(tokenizer))
    if known is None:
        known = _pickled[id(tokenizer)] = (str(next(_keys)), pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL))
        weakref.finalize(tokenizer, _pickled.pop, id(tokenizer), None)
    return known


def _write(proc: subprocess.Popen, data: bytes, deadline: float) -> None:
    fd = proc.stdin.fileno()
    view = memoryview(data)
    while view:
        if not select.select([], [fd], [], max(0.0, deadline - time.monotonic()))[1]:
            raise _Late
        view = view[os.write(fd, view[:READ_BYTES]):]


def _read(proc: subprocess.Popen, n: int, deadline: float) -> bytes:
    data = b""
    while len(data) < n:
        if not select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
            raise _Late
        chunk = proc.stdout.read(min(n - len(data), READ_BYTES))
        if not chunk:
            raise BrokenPipeError("the tokenising child exited")
        data += chunk
    return data


def _answer(proc: subprocess.Popen, deadline: float):
    return pickle.loads(_read(proc, int.from_bytes(_read(proc, HEADER_BYTES, deadline), "little"), deadline))


def _from_child(proc, tokenizer, job: tuple, results: list, deadline: float) -> None:
    """Append the child's results for ``job`` to ``results`` piece by piece, sending the tokenizer first
    if the child has not got it. _Late past the deadline; RuntimeError when the child failed."""
    _write(proc, framed(job), deadline)
    answer = _answer(proc, deadline)
    if answer[0] == "missing":
        key, blob = _tokenizer_message(tokenizer)
        _write(proc, framed(("tokenizer", key, blob)) + framed(job), deadline)
        answer = _answer(proc, deadline)
    while answer[0] == "piece":
        results.extend(answer[1])
        answer = _answer(proc, deadline)
    if answer[0] == "error":
        raise RuntimeError(answer[1])


def in_idle_time(tokenizer, op: str, items: list, max_tokens: int, piece: int, patience_s: float) -> list:
    """``tokenised(tokenizer, op, items, max_tokens)``, by a SCHED_IDLE child ``piece`` items at a time;
    what it has not done after ``patience_s`` the caller does. A kept child that turns out to have
    exited (killed while idle; an exit not yet reaped looks alive) is replaced by a new one once."""
    deadline = time.monotonic() + patience_s
    job = ("job", _tokenizer_message(tokenizer)[0], op, items, max_tokens, piece)
    results: list = []
    for fresh in (False, True):
        proc = _children.take(fresh)
        try:
            _from_child(proc, tokenizer, job, results, deadline)
        except _Late:
            kill(proc)
        except OSError as e:
            kill(proc)
            if not fresh and not results:
                continue
            log.info("the tokenising child failed (%s): the request's thread tokenises the rest", e)
        except (RuntimeError, pickle.UnpicklingError, EOFError) as e:
            log.info("the tokenising child failed (%s): the request's thread tokenises the rest", e)
            kill(proc)
        else:
            _children.give_back(proc)
            return results
        break
    return results + tokenised(tokenizer, op, items[len(results):], max_tokens)
