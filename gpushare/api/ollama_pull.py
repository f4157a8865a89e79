"""Ollama's /api/pull (streamed progress, as `ollama pull` draws it) and /api/blobs/<digest> (HEAD, POST).

/api/pull answers what catalog/pull.py does, as NDJSON lines: `{"status": "pulling manifest"}`,
then for each layer `{"status": "pulling <12 hex>", "digest", "total", "completed"}` as it grows,
`verifying sha256 digest`, `writing manifest`, `success`. An error found before the first line
(a bad or unknown name, a bad manifest, too little disk) is a plain HTTP error; after it, an
`{"error"}` line. A pull waiting its turn (server.max_pulls) answers at once with a `queued: ...`
line. `"stream": false` answers the last line only. A second pull of a name
being pulled watches the first. With tenants, starting a pull and uploading blobs are
admin-only, and so is asking whether a blob is stored; anyone may watch one under way. /api/blobs stores an upload under its digest
once its SHA-256 matches (Ollama's clients upload the files of a `create` this way).
"""

from __future__ import annotations

import asyncio
import json
import os

from aiohttp import web

from gpushare.api.context import context
from gpushare.api.errors import ApiError, bad_request
from gpushare.api.fields import field, read_json_object
from gpushare.api.tenants import check_admin
from gpushare.catalog import blob_store
from gpushare.catalog.blob_store import StoreError
from gpushare.catalog.low_priority import run_low
from gpushare.catalog.names import BadName, parse_name
from gpushare.catalog.pull import Pull, PullError

PROGRESS_INTERVAL_S = 0.1
UPLOAD_CHUNK_BYTES = 1 << 20


def _lines(pull: Pull, shown: dict) -> list[dict]:
    """The progress lines that changed since `shown` (updated)."""
    lines = []
    if pull.queued and shown.get("queued") != pull.queued:
        shown["queued"] = pull.queued
        lines.append({"status": pull.queued})
    if pull.queued:
        return lines
    if "manifest" not in shown:
        shown["manifest"] = True
        lines.append({"status": "pulling manifest"})
    for layer in pull.layers:
        if shown.get(layer.digest) != layer.completed:
            shown[layer.digest] = layer.completed
            label = layer.digest[7:19] if layer.digest.startswith("sha256:") else layer.digest
            lines.append({"status": f"pulling {label}", "digest": layer.digest, "total": layer.total,
                          "completed": layer.completed})
    steps = pull.steps[shown.get("steps", 0):]
    shown["steps"] = len(pull.steps)
    lines += [{"status": step} for step in steps if step not in ("downloading", "success")]
    return lines


async def _stream(request: web.Request, pull: Pull) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    shown: dict = {}
    while True:
        await asyncio.wait({pull.task}, timeout=PROGRESS_INTERVAL_S)
        lines = _lines(pull, shown)
        if pull.task.done():
            error = pull.task.exception() if not pull.task.cancelled() else PullError("the pull was cancelled", 500)
            lines.append({"error": str(error)} if error else {"status": "success"})
        if lines:
            await response.write(b"".join(json.dumps(line).encode() + b"\n" for line in lines))
        if pull.task.done():
            break
    await response.write_eof()
    return response


async def pull(request: web.Request) -> web.StreamResponse:
    body = await read_json_object(request)
    model = field(body, "model", "string") or field(body, "name", "string")
    if not model:
        raise bad_request('"model" is required', param="model")
    insecure = field(body, "insecure", "boolean", False)
    stream = field(body, "stream", "boolean", True)
    try:
        name = parse_name(model, insecure)
    except BadName as e:
        raise bad_request(str(e), param="model") from None
    pulls = context(request).pulls
    job = pulls.get(name)
    if job is None:
        check_admin(request, "pull models")
        job = pulls.start(name)
    job.watchers += 1
    try:
        answering = asyncio.ensure_future(job.answering.wait())  # checked, or waiting its turn
        await asyncio.wait({job.task, answering}, return_when=asyncio.FIRST_COMPLETED)
        answering.cancel()
        if job.task.done() and not job.task.cancelled() and job.task.exception() is not None:
            error = job.task.exception()
            raise ApiError(getattr(error, "status", 500), str(error))
        if stream:
            return await _stream(request, job)
        try:
            await asyncio.shield(job.task)
        except PullError as e:
            raise ApiError(e.status, str(e)) from None
        return web.json_response({"status": "success"})
    finally:
        pulls.leave(job)


async def head_blob(request: web.Request) -> web.Response:
    """200 or 404: whether the blob is stored. With tenants, admins only: only they may upload blobs and
    create models from them, and to anyone else the answer would tell whether some model or upload on the
    node holds a file whose digest they can guess (a blob-existence oracle)."""
    check_admin(request, "probe blobs (HEAD /api/blobs)")
    digest = request.match_info["digest"]
    try:
        path = blob_store.blob_path(context(request).settings.models_dir, digest)
    except StoreError as e:
        raise bad_request(str(e)) from None
    return web.Response(status=200 if path.is_file() else 404)


async def post_blob(request: web.Request) -> web.Response:
    """Store the request body as the blob `digest` (201), if its SHA-256 is that digest."""
    check_admin(request, "upload blobs")
    root = context(request).settings.models_dir
    digest = request.match_info["digest"]
    try:
        blob_store.check_digest(digest)
        # A chunked upload (Ollama's Go client sends one) has no length up front: it is checked as it grows.
        free = blob_store.check_free_space(root, request.content_length or 0, what="this upload")
        if blob_store.blob_path(root, digest).is_file():
            await _drain(request)
            return web.Response(status=201)
        fd = blob_store.open_partial(root, digest, 0)
        try:
            size = 0
            async for chunk in request.content.iter_chunked(UPLOAD_CHUNK_BYTES):
                size += len(chunk)
                blob_store.check_free_space(root, size, free, what="this upload")
                os.write(fd, chunk)
        except (OSError, StoreError) as e:
            blob_store.discard_partial(root, digest)
            await _drain(request)
            if isinstance(e, OSError):
                raise StoreError(f"cannot store the blob in {root}: {e.strerror}") from None
            raise
        finally:
            os.close(fd)
        await run_low(blob_store.commit_partial, root, digest)
    except StoreError as e:
        raise bad_request(str(e)) from None
    except BaseException:  # the client left mid-upload: nothing of it stays
        blob_store.discard_partial(root, digest)
        raise
    return web.Response(status=201)


async def _drain(request: web.Request) -> None:
    """Read what the client still sends, writing none of it: a reply mid-upload resets the connection,
    and the client would see that, not the reply."""
    async for _ in request.content.iter_chunked(UPLOAD_CHUNK_BYTES):
        pass


def add_routes(app: web.Application) -> None:
    app.router.add_post("/api/pull", pull)
    app.router.add_head("/api/blobs/{digest}", head_blob)
    app.router.add_post("/api/blobs/{digest}", post_blob)
