"""Fetching one blob into the store: ranges in parallel, resumed where a cut or a restart left them.

A blob of PART_MIN_BYTES or more is split into up to MAX_PARTS ranges fetched at once (as
Ollama does: one connection rarely fills a fast link). Each range goes on from its last
written byte: a cut connection is retried with `Range` from there, after a backoff that
doubles up to MAX_BACKOFF_S, and MAX_RETRIES failures in a row without a byte end the pull.
How much of each range is written is saved (blob_store.Partial) every SAVE_EVERY_S, so a
daemon that restarts resumes too. `fetch_blob` runs in a lowest-priority process of the pull's
own (pull_child.py), and writes the bytes at their offsets with `pwrite`. A full disk ends the
pull, deleting the partial. `fetch_file` brings one file of a Hugging Face repo (hf_pull.py) the
same way, in one range: never more than the size the listing gives, whatever the mirror sends.
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
from gpushare.catalog.registry_client import Remote, RegistryError, open_blob

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
    """Reports the blob's progress and saves the partial's state at most every SAVE_EVERY_S (each
    range calls it as it writes)."""

    def __init__(self, root: Path, digest: str, partial: Partial, report):
        self.root, self.digest, self.partial, self.last = root, digest, partial, time.monotonic()
        self.report = report  # (completed bytes, final=False) -> None

    def tick(self, force: bool = False) -> None:
        self.report(self.partial.written, final=force)
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


async def _fetch_range(remote: Remote, digest: str, fd: int, rng: list[int], saver: _Saver, root: Path,
                       max_retries: int, pace) -> None:
    failures = 0
    while rng[0] + rng[2] < rng[1]:
        try:
            response = await open_blob(remote, digest, rng[0] + rng[2], rng[1])
            async with response:
                async for chunk in response.content.iter_chunked(CHUNK_BYTES):
                    chunk = chunk[:rng[1] - rng[0] - rng[2]]  # never past the range, whatever is sent
                    _write(fd, chunk, rng[0] + rng[2], root)
                    rng[2] += len(chunk)
                    failures = 0
                    saver.tick()
                    await pace(len(chunk))
                    if rng[0] + rng[2] >= rng[1]:
                        break
            if rng[0] + rng[2] < rng[1]:
                raise aiohttp.ClientPayloadError(f"the answer ended {rng[1] - rng[0] - rng[2]} bytes short")
        except (aiohttp.ClientError, asyncio.TimeoutError, RegistryError) as e:
            if isinstance(e, RegistryError) and e.status == 404:
                raise
            failures += 1
            if failures > max_retries:
                raise RegistryError(f"blob {digest}: gave up after {max_retries} retries in a row "
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


async def fetch_blob(remote: Remote, root: Path, digest: str, size: int, ranges: list[list[int]], max_retries: int,
                     report, pace) -> None:
    """Bring the blob's bytes into its partial file, going on from what an earlier try saved, else
    fetching ``ranges``; ``report(completed, final=False)`` as they come, and ``await pace(n)``
    after each n bytes received (run by pull_child)."""
    partial = blob_store.read_partial(root, digest, size) or Partial(size, ranges)
    fd = blob_store.open_partial(root, digest, size)
    saver = _Saver(root, digest, partial, report)
    try:
        saver.tick(force=True)
        await _all_or_none(_fetch_range(remote, digest, fd, rng, saver, root, max_retries, pace) for rng in partial.ranges)
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


async def fetch_file(session: aiohttp.ClientSession, url: str, headers: dict, path: Path, size: int,
                     max_retries: int, report, pace) -> None:
    """Bring ``url``'s ``size`` bytes into ``path``, going on from what it holds (`Range`); an answer that
    says or shows it is longer than that is refused, and what was written of it deleted: a mirror
    cannot write more than the listing said (whose sizes the free-space check counted)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        have = min(os.fstat(fd).st_size, size)
        os.ftruncate(fd, have)
        failures = 0
        while have < size:  # (an empty file needs no request)
            try:
                async with session.get(url, headers={**headers, "Range": f"bytes={have}-"}) as response:
                    if response.status == 200:
                        have = 0  # the whole file again: the server ignored the range
                    elif response.status != 206:
                        raise RegistryError(f"{url} answered {response.status}",
                                            response.status if response.status in (401, 403, 404) else 502)
                    if response.content_length is not None and have + response.content_length > size:
                        raise _Oversized(f"{url} answered {have + response.content_length} bytes, more than the "
                                         f"{size} bytes the listing gives: refused")
                    async for chunk in response.content.iter_chunked(CHUNK_BYTES):
                        if have + len(chunk) > size:
                            raise _Oversized(f"{url} sent more than the {size} bytes the listing gives: refused")
                        _write(fd, chunk, have, path.parent)
                        have += len(chunk)
                        failures = 0
                        report(have)
                        await pace(len(chunk))
                os.ftruncate(fd, have)
                if have < size:
                    raise aiohttp.ClientPayloadError(f"the answer ended {size - have} bytes short")
            except (aiohttp.ClientError, asyncio.TimeoutError, RegistryError) as e:
                if isinstance(e, RegistryError) and e.status in (401, 403, 404):
                    raise  # refused, not a passing fault (a 5xx or 429 is tried again, as fetch_blob does)
                failures += 1
                if failures > max_retries:
                    raise RegistryError(f"{url}: gave up after {max_retries} retries in a row "
                                        f"({type(e).__name__}: {e})") from None
                await asyncio.sleep(min(BACKOFF_S * 2 ** (failures - 1), MAX_BACKOFF_S))
        report(have, final=True)
    except _Oversized as e:
        os.close(fd)
        fd = -1
        path.unlink(missing_ok=True)
        raise RegistryError(str(e)) from None
    finally:
        if fd >= 0:
            os.close(fd)


class _Oversized(Exception):
    pass
