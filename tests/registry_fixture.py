"""A model registry on 127.0.0.1 for the pull tests: Ollama's registry protocol and Hugging Face's API.

`Registry` serves, from a thread with its own event loop:
- `/v2/<namespace>/<name>/manifests/<tag>` and `/v2/<namespace>/<name>/blobs/<digest>` (GET and HEAD,
  `Range: bytes=a-b` answered 206), optionally behind Docker's Bearer token flow (`/token`);
- Hugging Face's `/api/models/<repo>[/revision/<rev>]` and `/<repo>/resolve/<rev>/<file>` (what
  huggingface_hub calls), recording the Authorization it gets.
Every request is logged (`requests`: method, path, Range, Authorization, bytes sent). Faults for the
tests: `cut_after[digest] = n` closes the connection after n bytes of that blob's next answer (once);
`corrupt` holds digests served with one byte changed; `held[key]`, an Event, holds the answers for
that key (a blob's digest, a Hugging Face file's `user/repo/file`) until it is set; `on_blob(key)`
is called as one starts. A hostile registry's: `token_body_bytes` (the
token service answers that many bytes, counting what it got to send in `token_sent`),
`manifest_answers[(namespace, name, tag)] = (status, headers, body)` (a redirect, an error page), and
an HfRepo's `listed` sizes (what the listing says, whatever is sent).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

MEDIA = "application/vnd.ollama.image."
CHUNK = 64 << 10


@dataclass
class Seen:
    method: str
    path: str
    range: str | None
    authorization: str | None
    sent: int = 0


@dataclass
class HfRepo:
    files: dict[str, Path | bytes]
    sha: str = "0123456789abcdef0123456789abcdef01234567"
    listed: dict[str, int] = field(default_factory=dict)  # a file's size as the listing gives it (a lie)

    def raw(self, name: str) -> bytes:
        data = self.files[name]
        return data if isinstance(data, bytes) else data.read_bytes()


def _read(data: Path | bytes, start: int, end: int) -> bytes:
    if isinstance(data, bytes):
        return data[start:end]
    with open(data, "rb") as f:
        f.seek(start)
        return f.read(end - start)


@dataclass
class Registry:
    blobs: dict[str, Path | bytes] = field(default_factory=dict)
    manifests: dict[tuple[str, str, str], bytes] = field(default_factory=dict)
    hf_repos: dict[str, HfRepo] = field(default_factory=dict)
    requests: list[Seen] = field(default_factory=list)
    cut_after: dict[str, int] = field(default_factory=dict)
    corrupt: set[str] = field(default_factory=set)
    token: str | None = None  # when set: Docker's Bearer flow, /token hands out this
    on_blob: object = None  # called with the key (digest, user/repo/file) as a file's answer starts
    held: dict[str, threading.Event] = field(default_factory=dict)  # a blob's answer waits until it is set
    bytes_per_s: float | None = None  # each answer's link speed (None: as fast as loopback goes)
    token_body_bytes: int | None = None  # the token service's answer: this many bytes of one JSON string
    token_sent: int = 0  # bytes of that answer written before the client hung up
    token_ended: threading.Event = field(default_factory=threading.Event)  # that answer is over
    manifest_answers: dict[tuple[str, str, str], tuple[int, dict, bytes]] = field(default_factory=dict)
    port: int = 0

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def add_blob(self, data: bytes | Path) -> dict:
        raw = data.read_bytes() if isinstance(data, Path) else data
        digest = "sha256:" + hashlib.sha256(raw).hexdigest()
        self.blobs[digest] = data
        return {"digest": digest, "size": len(raw)}

    def add_model(self, namespace: str, name: str, tag: str, gguf: Path | bytes,
                  layers: dict[str, bytes | str | dict] | None = None) -> dict:
        """A manifest as Ollama's registry serves one: config blob, the GGUF and the text layers."""
        out = [{"mediaType": MEDIA + "model", **self.add_blob(gguf)}]
        for kind, content in (layers or {}).items():
            data = json.dumps(content).encode() if isinstance(content, dict) else \
                content.encode() if isinstance(content, str) else content
            out.append({"mediaType": MEDIA + kind, **self.add_blob(data)})
        config = self.add_blob(json.dumps({"model_format": "gguf", "model_family": "llama"}).encode())
        manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                    "config": {"mediaType": "application/vnd.docker.container.image.v1+json", **config},
                    "layers": out}
        self.manifests[(namespace, name, tag)] = json.dumps(manifest).encode()
        return manifest

    def blob_requests(self, digest: str) -> list[Seen]:
        return [r for r in self.requests if r.path.endswith(digest) and r.method == "GET"]

    # ------------------------------------------------------------------ handlers

    def _authorized(self, request: web.Request) -> bool:
        return self.token is None or request.headers.get("Authorization") == f"Bearer {self.token}"

    def _challenge(self) -> web.Response:
        realm = f"http://{self.host}/token"
        return web.Response(status=401, headers={
            "WWW-Authenticate": f'Bearer realm="{realm}",service="test-registry",scope="repository:pull"'})

    async def _token(self, request: web.Request) -> web.Response:
        ok = request.query.get("service") == "test-registry" and request.query.get("scope") == "repository:pull"
        if self.token_body_bytes is not None:
            return await self._endless_token(request)
        return web.json_response({"token": self.token}) if ok else web.Response(status=400)

    async def _endless_token(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})  # chunked: no length
        await response.prepare(request)
        self.token_sent = 0
        piece = b'{"token": "' + b"x" * (CHUNK - 11)
        try:
            while self.token_sent < self.token_body_bytes:
                await response.write(piece)
                self.token_sent += len(piece)
                piece = b"x" * CHUNK
            await response.write(b'"}')
            await response.write_eof()
        except (ConnectionError, RuntimeError):  # the client hung up (aiohttp says so either way)
            pass
        finally:
            self.token_ended.set()
        return response

    async def _manifest(self, request: web.Request) -> web.Response:
        self.requests.append(Seen(request.method, request.path, None, request.headers.get("Authorization")))
        if not self._authorized(request):
            return self._challenge()
        m = request.match_info
        if (m["namespace"], m["name"], m["tag"]) in self.manifest_answers:
            status, headers, body = self.manifest_answers[(m["namespace"], m["name"], m["tag"])]
            return web.Response(status=status, headers=headers, body=body)
        body = self.manifests.get((m["namespace"], m["name"], m["tag"]))
        if body is None:
            return web.json_response({"errors": [{"code": "MANIFEST_UNKNOWN"}]}, status=404)
        return web.Response(body=body, content_type="application/vnd.docker.distribution.manifest.v2+json")

    async def _send_file(self, request: web.Request, data: Path | bytes, digest: str | None,
                         headers: dict | None = None, key: str | None = None) -> web.StreamResponse:
        seen = Seen(request.method, request.path, request.headers.get("Range"), request.headers.get("Authorization"))
        self.requests.append(seen)
        key = key or digest
        if self.on_blob is not None and key:
            self.on_blob(key)
        if key in self.held:
            await asyncio.get_running_loop().run_in_executor(None, self.held[key].wait, 120)
        size = data.stat().st_size if isinstance(data, Path) else len(data)
        start, end, status = 0, size, 200
        if seen.range:
            a, _, b = seen.range.removeprefix("bytes=").partition("-")
            start, end, status = int(a), min(int(b) + 1 if b else size, size), 206
        headers = {**(headers or {}), "Content-Length": str(end - start), "Accept-Ranges": "bytes"}
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        response = web.StreamResponse(status=status, headers=headers)
        await response.prepare(request)
        if request.method == "HEAD":
            return response
        cut = self.cut_after.pop(digest, None) if digest else None
        for offset in range(start, end, CHUNK):
            piece = _read(data, offset, min(offset + CHUNK, end))
            if digest in self.corrupt and offset + len(piece) == size:
                piece = piece[:-1] + bytes([piece[-1] ^ 1])
            if cut is not None and seen.sent + len(piece) > cut:
                piece = piece[:cut - seen.sent]
                await response.write(piece)
                seen.sent += len(piece)
                request.transport.close()  # flushes what was written, then FIN: a connection cut mid-blob
                return response
            await response.write(piece)
            seen.sent += len(piece)
            if self.bytes_per_s:
                await asyncio.sleep(len(piece) / self.bytes_per_s)
        await response.write_eof()
        return response

    async def _blob(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            self.requests.append(Seen(request.method, request.path, None, request.headers.get("Authorization")))
            return self._challenge()
        digest = request.match_info["digest"]
        if digest not in self.blobs:
            return web.json_response({"errors": [{"code": "BLOB_UNKNOWN"}]}, status=404)
        return await self._send_file(request, self.blobs[digest], digest)

    async def _hf_info(self, request: web.Request) -> web.Response:
        self.requests.append(Seen(request.method, request.path, None, request.headers.get("Authorization")))
        repo = self.hf_repos.get(f"{request.match_info['user']}/{request.match_info['repo']}")
        if repo is None:
            return web.json_response({"error": "Repository not found"}, status=404)
        siblings = []
        for name in repo.files:
            raw = repo.raw(name)
            size = repo.listed.get(name, len(raw))
            entry = {"rfilename": name, "size": size, "blobId": hashlib.sha1(raw).hexdigest()}
            if name.endswith(".safetensors"):
                entry["lfs"] = {"sha256": hashlib.sha256(raw).hexdigest(), "size": size, "pointerSize": 134}
            siblings.append(entry)
        return web.json_response({"id": request.match_info["user"] + "/" + request.match_info["repo"],
                                  "sha": repo.sha, "siblings": siblings, "private": False})

    async def _hf_file(self, request: web.Request) -> web.StreamResponse:
        repo = self.hf_repos.get(f"{request.match_info['user']}/{request.match_info['repo']}")
        filename = request.match_info["tail"].rpartition("/")[2]  # after the revision, whatever it holds
        path = repo and repo.files.get(filename)
        if path is None:
            self.requests.append(Seen(request.method, request.path, None, request.headers.get("Authorization")))
            return web.json_response({"error": "Entry not found"}, status=404,
                                     headers={"X-Error-Code": "EntryNotFound"})
        raw = repo.raw(filename)
        etag = hashlib.sha256(raw).hexdigest() if filename.endswith(".safetensors") else hashlib.sha1(raw).hexdigest()
        return await self._send_file(request, path, None, {"X-Repo-Commit": repo.sha, "ETag": f'"{etag}"'},
                                     key=f"{request.match_info['user']}/{request.match_info['repo']}/{filename}")

    def app(self) -> web.Application:
        app = web.Application()
        v2 = "/v2/{namespace}/{name}"
        app.router.add_get(v2 + "/manifests/{tag}", self._manifest)
        app.router.add_get(v2 + "/blobs/{digest}", self._blob)  # aiohttp adds HEAD for GET routes
        app.router.add_get("/token", self._token)
        app.router.add_get("/api/models/{user}/{repo}", self._hf_info)
        app.router.add_get("/api/models/{user}/{repo}/revision/{revision}", self._hf_info)
        app.router.add_get("/{user}/{repo}/resolve/{tail:.+}", self._hf_file)
        return app


class Serving:
    """`registry` served on 127.0.0.1 from a thread until stop()."""

    def __init__(self, registry: Registry):
        self.registry = registry
        self.loop = asyncio.new_event_loop()
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        if not self.started.wait(30):
            raise RuntimeError("the test registry did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        runner = web.AppRunner(self.registry.app())
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.registry.port = site._server.sockets[0].getsockname()[1]
        self.runner = runner
        self.started.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())
        self.loop.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
