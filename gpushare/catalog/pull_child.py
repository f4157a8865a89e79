"""A pull's blobs fetched and hashed in a process of its own, at the lowest priority.

Why a process: the daemon's threads share one GIL. A download thread at nice 19 still takes the
GIL for every received chunk, and when the engines' threads take the cores while it holds it, the
API's loop waits for it: with benchmarks/pull_ttft.py a chat's TTFT during a 2 GiB pull was 1.49x
and 1.59x its TTFT alone with the download in a thread of the daemon, and 1.02x with the same
download in a nice-19 process of its own (docs/benchmarks.md).

`download` and `verify` hand a pull's blobs to `run` (and `download_files` a Hugging Face repo's files,
hf_pull.py), which starts
`python -m gpushare.catalog.pull_child`, writes it one job (JSON on its stdin) and
reads its events (a JSON object a line on its stdout) until it exits:
- `{"digest", "completed"}`: a blob's bytes so far, at most every PROGRESS_EVERY_S and at its end;
- `{"error", "kind"[, "status"]}`: what ended it, raised again in the daemon as the same error
  (a RegistryError with its HTTP status, or a StoreError).
While the daemon's models are busy it sends the child a cap, `{"bytes_per_s"}` on its stdin
(`server.pull_rate_while_serving`): on a fast link (localhost in the benchmark, GB/s) the download's
copies still cost the engines TTFT, 1.0-1.4x in a nice-19 process uncapped against 0.95-1.03x
with the registry sending 200 MB/s.
Cancelling `run` sends the child SIGTERM: it cancels its work, whose `finally`s save each partial's
state and close its files, and exits; `run` waits for that before raising. A child whose stdin
closes (the daemon died) ends the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from gpushare.catalog import blob_download, blob_store
from gpushare.catalog.blob_download import LayerProgress
from gpushare.catalog.blob_store import StoreError
from gpushare.catalog.names import PullName
from gpushare.catalog.registry_client import Remote, RegistryError, new_session

LOWEST_NICE = 19
PROGRESS_EVERY_S = 0.1
CAP_EVERY_S = 0.1  # how often the daemon asks whether its models are busy
CAP_HOLD_S = 1.0  # the cap stays this long after the last busy answer (chats come one after another)
BURST_S = 0.05  # a capped download may run this far ahead of its rate


class ChildDied(Exception):
    """The child ended without saying why (killed, or a bug): what it wrote stays, to resume."""


async def _send_caps(child, cap_of) -> None:
    """Tell the child its download cap, `{"bytes_per_s": n or null}`, whenever it changes: ``cap_of()``
    while the daemon's models are busy, and for CAP_HOLD_S after."""
    sent, held, busy_until = None, None, 0.0
    while True:
        cap = cap_of()
        now = time.monotonic()
        if cap:
            busy_until, held = now + CAP_HOLD_S, cap
        wanted = held if now < busy_until else None
        if wanted != sent:
            child.stdin.write(json.dumps({"bytes_per_s": wanted}).encode() + b"\n")
            await child.stdin.drain()
            sent = wanted
        await asyncio.sleep(CAP_EVERY_S)


async def run(job: dict, on_progress, cap_of=lambda: None) -> None:
    """Do ``job`` in a child process; ``on_progress(digest, completed)`` for each progress event (a
    download's; a verify sends none);
    ``cap_of()``: the bytes per second its downloads may take now (None: as fast as they come).
    Raises the child's RegistryError or StoreError, or ChildDied."""
    child = await asyncio.create_subprocess_exec(sys.executable, "-m", "gpushare.catalog.pull_child",
                                                 stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    error, caps = None, None
    try:
        child.stdin.write(json.dumps(job).encode() + b"\n")
        await child.stdin.drain()
        caps = asyncio.ensure_future(_send_caps(child, cap_of))
        while line := await child.stdout.readline():
            event = json.loads(line)
            if "error" in event:
                error = event
            elif on_progress is not None:
                on_progress(event["digest"], event["completed"])
        code = await child.wait()
    except asyncio.CancelledError:
        if child.returncode is None:
            child.send_signal(signal.SIGTERM)
            await asyncio.shield(child.wait())
        raise
    finally:
        if caps is not None:
            caps.cancel()
            await asyncio.gather(caps, return_exceptions=True)
    if error is not None:
        if error["kind"] == "registry":
            raise RegistryError(error["error"], error["status"])
        raise StoreError(error["error"])
    if code != 0:
        raise ChildDied(f"the pull's download process ended with exit code {code}")


def _progress_into(layers: list[LayerProgress]):
    by_digest = {layer.digest: layer for layer in layers}

    def on_progress(digest: str, completed: int) -> None:
        by_digest[digest].completed = completed
    return on_progress


async def download(remote: Remote, root: Path, layers: list[LayerProgress], cap_of=lambda: None) -> None:
    """Bring each layer's bytes into its partial file (their SHA-256 is checked by verify, after),
    in the pull's own process, at most ``cap_of()`` bytes a second when it says so; a layer already
    in the store counts as complete."""
    todo = []
    for layer in layers:
        if blob_store.has_blob(root, layer.digest, layer.total):
            layer.completed = layer.total
        else:
            todo.append([layer.digest, layer.total, blob_download.plan_ranges(layer.total)])
    if todo:
        job = {"op": "download", "root": str(root), "name": dataclasses.asdict(remote.name),
               "headers": remote.headers, "blobs": todo, "max_retries": blob_download.MAX_RETRIES}
        await run(job, _progress_into(layers), cap_of)


async def verify(root: Path, layers: list[LayerProgress]) -> None:
    """Check each downloaded partial's SHA-256 and make it the blob (DigestMismatch, with nothing of
    it kept, where it is not), in the pull's own process: hashing gigabytes takes a while."""
    todo = [[layer.digest, layer.total] for layer in layers if not blob_store.has_blob(root, layer.digest, layer.total)]
    if todo:
        await run({"op": "verify", "root": str(root), "blobs": todo}, on_progress=None)


async def download_files(name: PullName, files: list[tuple[str, Path, LayerProgress]], cap_of=lambda: None) -> None:
    """Bring each (url, path, layer) file into its path, at most ``layer.total`` bytes of it
    (blob_download.fetch_file), in the pull's own process as `download` does."""
    if not files:
        return
    job = {"op": "files", "name": dataclasses.asdict(name),
           "files": [[url, str(path), layer.total, layer.digest] for url, path, layer in files],
           "max_retries": blob_download.MAX_RETRIES}
    await run(job, _progress_into([layer for _, _, layer in files]), cap_of)


def _report(event: dict) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


class _Pace:
    """The child's download cap, shared by its ranges: each received chunk waits its turn."""

    def __init__(self):
        self.bytes_per_s: float | None = None
        self.next_s = 0.0  # when the bytes taken so far are due, at the cap

    async def __call__(self, n: int) -> None:
        now = time.monotonic()
        if not self.bytes_per_s:
            self.next_s = now
            return
        self.next_s = max(self.next_s, now) + n / self.bytes_per_s
        if self.next_s - now > BURST_S:
            await asyncio.sleep(self.next_s - now - BURST_S)


class _Reporter:
    """Progress events for one blob, at most every PROGRESS_EVERY_S (the last one always)."""

    def __init__(self, digest: str):
        self.digest, self.last_s = digest, 0.0

    def __call__(self, completed: int, final: bool = False) -> None:
        now = time.monotonic()
        if final or now - self.last_s >= PROGRESS_EVERY_S:
            _report({"digest": self.digest, "completed": completed})
            self.last_s = now


async def _do(job: dict, pace: _Pace) -> None:
    if job["op"] == "verify":
        for digest, _ in job["blobs"]:
            blob_store.commit_partial(Path(job["root"]), digest)
        return
    async with new_session() as session:
        if job["op"] == "files":
            remote = Remote(PullName(**job["name"]), session)
            for url, path, size, label in job["files"]:
                await blob_download.fetch_file(session, url, remote.headers, Path(path), size, job["max_retries"],
                                               _Reporter(label), pace)
            return
        remote = Remote(PullName(**job["name"]), session, dict(job["headers"]))
        for digest, size, ranges in job["blobs"]:
            await blob_download.fetch_blob(remote, Path(job["root"]), digest, size, ranges, job["max_retries"], _Reporter(digest),
                                           pace)


def main() -> int:
    try:
        os.nice(LOWEST_NICE - os.nice(0))
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # refused: the work runs, at the priority it was given
        pass
    job = json.loads(sys.stdin.readline())
    loop, pace = asyncio.new_event_loop(), _Pace()
    task = loop.create_task(_do(job, pace))
    loop.add_signal_handler(signal.SIGTERM, task.cancel)

    def follow_caps_until_stdin_closes():
        for line in sys.stdin:
            loop.call_soon_threadsafe(setattr, pace, "bytes_per_s", json.loads(line)["bytes_per_s"])
        loop.call_soon_threadsafe(task.cancel)

    threading.Thread(target=follow_caps_until_stdin_closes, daemon=True).start()
    try:
        loop.run_until_complete(task)
    except asyncio.CancelledError:
        return 1
    except RegistryError as e:
        _report({"error": str(e), "kind": "registry", "status": e.status})
        return 1
    except StoreError as e:
        _report({"error": str(e), "kind": "store"})
        return 1
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
