"""The HTTP side of a pull: Ollama's registry protocol (Docker's v2 API) as a client.

`GET /v2/<namespace>/<model>/manifests/<tag>` gives the manifest and
`GET /v2/<namespace>/<model>/blobs/<digest>` a layer, with `Range` for a part of one (a
registry may redirect a blob to its CDN: its bytes are checked against the digest and capped at the
manifest's size). A 401 with `WWW-Authenticate: Bearer realm=...` is answered once with Docker's
token flow (`GET realm?service=..&scope=..` -> `{"token"}`); a name's own token (HF_TOKEN) is sent
from the start, and to a token realm only on the registry's own origin.
The registry is not trusted (docs/security.md): every answer read whole is read with a byte cap
(`read_capped`: a manifest MAX_MANIFEST_BYTES, a token MAX_TOKEN_BYTES, a listing its caller's), an
error page is quoted at most MAX_ECHO_CHARS, and `get_on_origin` follows redirects only on the
registry's own origin (scheme, host, port). Errors are RegistryError with the HTTP status the API
answers with.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import aiohttp
from yarl import URL

from gpushare.catalog.names import PullName

MANIFEST_TYPES = ("application/vnd.docker.distribution.manifest.v2+json, "
                  "application/vnd.oci.image.manifest.v1+json")
MAX_MANIFEST_BYTES = 4 << 20  # Ollama's manifests are about a kilobyte
MAX_TOKEN_BYTES = 64 << 10  # a Docker token answer is a JWT of a few kilobytes
MAX_ECHO_CHARS = 200  # of a registry's error page, quoted in the pull's error
MAX_REDIRECTS = 5
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


async def read_capped(response: aiohttp.ClientResponse, cap_bytes: int, what: str, kind: str) -> bytes:
    """The whole answer, refused (RegistryError 502) as soon as it says or shows it is over ``cap_bytes``:
    a registry that sends without end costs the daemon ``cap_bytes`` of memory, no more."""
    if (response.content_length or 0) > cap_bytes:
        raise RegistryError(f"{what} is {response.content_length} bytes, over the {cap_bytes} bytes {kind} may be")
    chunks, size = [], 0
    async for chunk in response.content.iter_chunked(64 << 10):
        size += len(chunk)
        if size > cap_bytes:
            raise RegistryError(f"{what} is over the {cap_bytes} bytes {kind} may be: refused, unread")
        chunks.append(chunk)
    return b"".join(chunks)


async def error_detail(response: aiohttp.ClientResponse) -> str:
    """The start of an error page, printable and at most MAX_ECHO_CHARS (it goes into the pull's error)."""
    try:
        head = await response.content.read(4 * MAX_ECHO_CHARS)  # at most this, maybe less: a hint only
    except (aiohttp.ClientError, OSError):
        return ""
    text = "".join(c if c.isprintable() else " " for c in head.decode(errors="replace")).strip()
    return text[:MAX_ECHO_CHARS] + ("..." if len(text) > MAX_ECHO_CHARS else "")


def _origin(url: URL) -> tuple:
    return url.scheme, url.host, url.explicit_port or url.port


async def get_on_origin(remote: Remote, url: str, headers: dict | None = None) -> aiohttp.ClientResponse:
    """GET ``url`` through `request`, following at most MAX_REDIRECTS redirects that stay on the registry's
    origin; one to another host is refused (RegistryError 502) without a request to it."""
    home = _origin(URL(remote.name.base_url))
    for _ in range(MAX_REDIRECTS + 1):
        response = await request(remote, "GET", url, headers, allow_redirects=False)
        if response.status not in (301, 302, 303, 307, 308):
            return response
        location = response.headers.get("Location", "")
        response.release()
        target = URL(url).join(URL(location))
        if _origin(target) != home:
            raise RegistryError(f"{url} answered with a redirect to {target.host}:{target.port}, another host than "
                                f"the registry's: refused (a manifest or listing is read from the registry only)")
        url = str(target)
    raise RegistryError(f"{url}: more than {MAX_REDIRECTS} redirects")


async def _authorize(remote: Remote, response: aiohttp.ClientResponse) -> bool:
    """Fetch a token for a 401's Bearer challenge; False when there is none to answer."""
    header = response.headers.get("WWW-Authenticate", "")
    if not header.lower().startswith("bearer"):
        return False
    params = _challenge(header)
    realm = params.pop("realm", "")
    if not realm.startswith(("http://", "https://")):
        return False
    # the name's own token (HF_TOKEN) goes to a realm on the registry's origin only
    own = _origin(URL(realm)) == _origin(URL(remote.name.base_url))
    async with remote.session.get(realm, params=params, headers=remote.headers if own else {},
                                  allow_redirects=False) as r:
        if r.status != 200:
            raise RegistryError(f"{remote.name.base_url}: the token service {realm} answered {r.status}", 401)
        body = await read_capped(r, MAX_TOKEN_BYTES, f"{remote.name.base_url}: the token service's answer",
                                 "a token answer")
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    token = doc.get("token") or doc.get("access_token") if isinstance(doc, dict) else None
    if not isinstance(token, str):
        raise RegistryError(f"{remote.name.base_url}: the token service {realm} gave no token", 401)
    remote.headers["Authorization"] = f"Bearer {token}"
    return True


async def request(remote: Remote, method: str, url: str, headers: dict | None = None,
                  allow_redirects: bool = True) -> aiohttp.ClientResponse:
    """`method url` with the pull's authorization, getting a token on the first 401; the caller closes it."""
    def send():
        return remote.session.request(method, url, headers={**remote.headers, **(headers or {})},
                                      allow_redirects=allow_redirects)

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
        response = await get_on_origin(remote, url, {"Accept": MANIFEST_TYPES})
    except aiohttp.ClientError as e:
        raise RegistryError(f"cannot reach the registry at {name.base_url}: {e}") from None
    async with response:
        if 400 <= response.status < 500:  # 404: no such name or tag; 401/403: not ours to pull
            detail = await error_detail(response)
            raise RegistryError(f'model "{name.display}" not found: {url} answered {response.status}'
                                + (f" ({detail})" if detail else ""), response.status)
        if response.status != 200:
            raise RegistryError(f"{url} answered {response.status} for the manifest")
        try:
            return await read_capped(response, MAX_MANIFEST_BYTES, f"the manifest at {url}", "a manifest")
        except RegistryError as e:
            raise RegistryError(str(e), 400) from None


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
