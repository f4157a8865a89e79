"""Fetching one blob into the store: ranges in parallel, resumed where a cut or a restart left them.

A blob of PART_MIN_BYTES or more is split into up to MAX_PARTS ranges fetched at once (as
Ollama does: one connection rarely fills a fast link). Each range goes on from its last
written byte: a cut connection is retried with `Range` from there, after a backoff that
doubles up to MAX_BACKOFF_S, and MAX_RETRIES failures in a row without a byte end the pull.
How much of each range is written is saved (blob_store.Partial) every SAVE_EVERY_S, so a
daemon that restarts resumes too. The ranges are fetched on an event loop and connections of
their own in a lowest-priority thread (low_priority.run_low_loop), so the daemon's loop, which
answers the API, never handles a blob's bytes; they are written at their offsets with `pwrite`.
Hashing the whole blob runs in a lowest-priority thread too. A full disk ends the pull, deleting
the partial.
"""

from __future__ import annotations

import asyncio
import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from gpushare.catalog import blob_store
from gpushare.catalog.blob_store import Partial, StoreError
from gpushare.catalog.low_priority import run_low, run_low_loop
from gpushare.catalog.registry_client import Remote, RegistryError, new_session, open_blob

PART_MIN_BYTES = 16 << 20
MAX_PARTS = 8
MAX_RETRIES = 5
BACKOFF_S = 0.25
MAX_BACKOFF_S = 8.0
CHUNK_BYTES = 256 << 10
SAVE_EVERY_S = 1.0


@dataclass
class LayerProgress:
    """One layer of a pull as its progress lines show it."""
    digest: str
    total: int
    completed: int = 0


def plan_ranges(size: int) -> list[list[int]]:
    """[start, end, written=0] ranges covering the blob: one, or up to MAX_PARTS of PART_MIN_BYTES or more."""
    parts = max(1, min(MAX_PARTS, size // PART_MIN_BYTES))
    step = -(-size // parts) if size else 0
    return [[start, min(start + step, size), 0] for start in range(0, size, step)] if size else []


class _Saver:
    """Saves the partial's state at most every SAVE_EVERY_S (each range calls it as it writes)."""

    def __init__(self, root: Path, digest: str, partial: Partial):
        self.root, self.digest, self.partial, self.last = root, digest, partial, time.monotonic()

    def tick(self, force: bool = False) -> None:
        if force or time.monotonic() - self.last >= SAVE_EVERY_S:
            try:
                blob_store.save_partial(self.root, self.digest, self.partial)
            except OSError as e:
                raise StoreError(f"cannot write into {self.root}: {e.strerror}") from None
            self.last = time.monotonic()


def _write(fd: int, data: bytes, offset: int, root: Path) -> None:
    try:
        while data:
            n = os.pwrite(fd, data, offset)
            data, offset = data[n:], offset + n
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreError(f"the disk holding {root} is full: {e.strerror}") from None
        raise StoreError(f"cannot write into {root}: {e.strerror}") from None


async def _fetch_range(remote: Remote, digest: str, fd: int, rng: list[int], progress: LayerProgress,
                       saver: _Saver, root: Path) -> None:
    failures = 0
    while rng[0] + rng[2] < rng[1]:
        try:
            response = await open_blob(remote, digest, rng[0] + rng[2], rng[1])
            async with response:
                async for chunk in response.content.iter_chunked(CHUNK_BYTES):
                    chunk = chunk[:rng[1] - rng[0] - rng[2]]  # never past the range, whatever is sent
                    _write(fd, chunk, rng[0] + rng[2], root)
                    rng[2] += len(chunk)
                    progress.completed += len(chunk)
                    failures = 0
                    saver.tick()
                    if rng[0] + rng[2] >= rng[1]:
                        break
            if rng[0] + rng[2] < rng[1]:
                raise aiohttp.ClientPayloadError(f"the answer ended {rng[1] - rng[0] - rng[2]} bytes short")
        except (aiohttp.ClientError, asyncio.TimeoutError, RegistryError) as e:
            if isinstance(e, RegistryError) and e.status == 404:
                raise
            failures += 1
            if failures > MAX_RETRIES:
                raise RegistryError(f"blob {digest}: gave up after {MAX_RETRIES} retries in a row "
                                    f"({type(e).__name__}: {e})") from None
            await asyncio.sleep(min(BACKOFF_S * 2 ** (failures - 1), MAX_BACKOFF_S))


async def _all_or_none(coroutines) -> None:
    """Run them together; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _fetch_ranges(remote: Remote, digest: str, fd: int, partial: Partial, progress: LayerProgress,
                        saver: _Saver, root: Path) -> None:
    """Every unfinished range at once, through a session of this thread's loop (a session belongs to
    the loop that made it) with the authorization the pull's own session earned."""
    async with new_session() as session:
        here = Remote(remote.name, session, dict(remote.headers))
        await _all_or_none(_fetch_range(here, digest, fd, rng, progress, saver, root) for rng in partial.ranges)


async def download(remote: Remote, root: Path, digest: str, progress: LayerProgress) -> None:
    """Bring the blob's bytes into its partial file (its SHA-256 is checked by commit, after)."""
    size = progress.total
    if blob_store.has_blob(root, digest, size):
        progress.completed = size
        return
    partial = blob_store.read_partial(root, digest, size) or Partial(size, plan_ranges(size))
    progress.completed = partial.written
    fd = blob_store.open_partial(root, digest, size)
    saver = _Saver(root, digest, partial)
    try:
        saver.tick(force=True)
        await run_low_loop(lambda: _fetch_ranges(remote, digest, fd, partial, progress, saver, root))
    except StoreError:  # the disk: nothing of it is worth keeping
        os.close(fd)
        fd = -1
        blob_store.discard_partial(root, digest)
        raise
    finally:
        if fd >= 0:
            os.close(fd)
            try:
                saver.tick(force=True)
            except StoreError:  # what is written stays; the next try re-fetches what was not recorded
                pass


async def commit(root: Path, digest: str, size: int) -> None:
    """Check the downloaded partial's SHA-256 and make it the blob (in a lowest-priority thread:
    hashing takes a while, and the engines come first)."""
    if not blob_store.has_blob(root, digest, size):
        await run_low(blob_store.commit_partial, root, digest)
