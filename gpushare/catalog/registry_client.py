"""The HTTP side of a pull: Ollama's registry protocol (Docker's v2 API) as a client.

`GET /v2/<namespace>/<model>/manifests/<tag>` gives the manifest and
`GET /v2/<namespace>/<model>/blobs/<digest>` a layer, with `Range` for a part of one (a
registry may redirect a blob to its CDN). A 401 with `WWW-Authenticate: Bearer realm=...`
is answered once with Docker's token flow (`GET realm?service=..&scope=..` -> `{"token"}`);
a name's own token (HF_TOKEN) is sent from the start. A manifest over MAX_MANIFEST_BYTES is
refused before it is read whole. Errors are RegistryError with the HTTP status the API answers with.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import aiohttp

from gpushare.catalog.names import PullName

MANIFEST_TYPES = ("application/vnd.docker.distribution.manifest.v2+json, "
                  "application/vnd.oci.image.manifest.v1+json")
MAX_MANIFEST_BYTES = 4 << 20  # Ollama's manifests are about a kilobyte
CONNECT_TIMEOUT_S = 30
READ_TIMEOUT_S = 60  # no byte for this long: the connection is taken as cut


class RegistryError(Exception):
    def __init__(self, message: str, status: int = 502):
        super().__init__(message)
        self.status = status


@dataclass
class Remote:
    """One pull's view of its registry: the name, and the authorization that worked."""
    name: PullName
    session: aiohttp.ClientSession
    headers: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.name.token:
            self.headers["Authorization"] = f"Bearer {self.name.token}"

    def url(self, kind: str, ref: str) -> str:
        return f"{self.name.base_url}/v2/{self.name.repository}/{kind}/{ref}"


def new_session() -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S, sock_read=READ_TIMEOUT_S)
    return aiohttp.ClientSession(timeout=timeout, auto_decompress=False)


def _challenge(header: str) -> dict[str, str]:
    """`Bearer realm="...",service="...",scope="..."` as a dict."""
    return dict(re.findall(r'(\w+)="([^"]*)"', header))


async def _authorize(remote: Remote, response: aiohttp.ClientResponse) -> bool:
    """Fetch a token for a 401's Bearer challenge; False when there is none to answer."""
    header = response.headers.get("WWW-Authenticate", "")
    if not header.lower().startswith("bearer"):
        return False
    params = _challenge(header)
    realm = params.pop("realm", "")
    if not realm.startswith(("http://", "https://")):
        return False
    async with remote.session.get(realm, params=params, headers=remote.headers) as r:
        if r.status != 200:
            raise RegistryError(f"{remote.name.base_url}: the token service {realm} answered {r.status}", 401)
        doc = await r.json(content_type=None)
    token = doc.get("token") or doc.get("access_token") if isinstance(doc, dict) else None
    if not isinstance(token, str):
        raise RegistryError(f"{remote.name.base_url}: the token service {realm} gave no token", 401)
    remote.headers["Authorization"] = f"Bearer {token}"
    return True


async def request(remote: Remote, method: str, url: str, headers: dict | None = None) -> aiohttp.ClientResponse:
    """`method url` with the pull's authorization, getting a token on the first 401; the caller closes it."""
    def send():
        return remote.session.request(method, url, headers={**remote.headers, **(headers or {})})

    response = await send()
    if response.status == 401 and await _authorize(remote, response):  # also a token that expired mid-pull
        response.release()
        response = await send()
    return response


async def fetch_manifest(remote: Remote) -> bytes:
    """The manifest's bytes; RegistryError 404 for an unknown name or tag, 400 for one too large."""
    name = remote.name
    url = remote.url("manifests", name.tag)
    try:
        response = await request(remote, "GET", url, {"Accept": MANIFEST_TYPES})
    except aiohttp.ClientError as e:
        raise RegistryError(f"cannot reach the registry at {name.base_url}: {e}") from None
    async with response:
        if 400 <= response.status < 500:  # 404: no such name or tag; 401/403: not ours to pull
            detail = (await response.content.read(2000)).decode(errors="replace").strip()
            raise RegistryError(f'model "{name.display}" not found: {url} answered {response.status}'
                                + (f" ({detail})" if detail else ""), response.status)
        if response.status != 200:
            raise RegistryError(f"{url} answered {response.status} for the manifest")
        if (response.content_length or 0) > MAX_MANIFEST_BYTES:
            raise RegistryError(f"the manifest at {url} is {response.content_length} bytes, over the "
                                f"{MAX_MANIFEST_BYTES} bytes a manifest may be", 400)
        body = await response.content.read(MAX_MANIFEST_BYTES + 1)
        if len(body) > MAX_MANIFEST_BYTES:
            raise RegistryError(f"the manifest at {url} is over the {MAX_MANIFEST_BYTES} bytes a manifest may be",
                                400)
        return body


async def open_blob(remote: Remote, digest: str, start: int, end: int) -> aiohttp.ClientResponse:
    """The bytes [start, end) of a blob, as a response to read (206, or 200 when it is the whole blob)."""
    url = remote.url("blobs", digest)
    response = await request(remote, "GET", url, {"Range": f"bytes={start}-{end - 1}"})
    whole = start == 0 and response.status == 200 and response.content_length in (None, end)
    ranged = response.status == 206 and response.headers.get("Content-Range", "").startswith(f"bytes {start}-")
    if not (ranged or whole):
        status = response.status
        response.release()
        raise RegistryError(f"{url} answered {status} to a range request", 404 if status == 404 else 502)
    return response
