"""A Hugging Face repo of safetensors (no GGUF) pulled through the Hub's HTTP API into the store, as a folder.

The listing (`GET /api/models/<repo>[/revision/<rev>]?blobs=true`) names the commit and each file's
size and, for LFS files, SHA-256. Only what loading needs is fetched (ALLOWED: weights, config,
tokenizer, chat template), one file at a time into a staging folder under the store
(`.hf-partial/<ns>--<repo>--<commit>/`, kept to resume a cut pull) by pull_child's process, at
most the listed size of each (blob_download.fetch_file). Each file's SHA-256 is checked against
the one the Hub lists for LFS files, then the file becomes a blob; the folder is
`folders/<config digest>/` with a link per file, and the manifest names the files as layers of
FILE_MEDIA and the folder by its config blob of FOLDER_MEDIA (ollama_store.read_manifest serves it
as an HF folder).
The mirror is not trusted (docs/security.md): the listing is read with a byte cap, its commit must
be 40 hex digits, its file names plain names and its sizes byte counts before any becomes a path or
a budget, the staging folder must resolve inside the store before a byte is written or it is
deleted, and the listing's redirects stay on the mirror's origin.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from urllib.parse import quote

from gpushare.catalog import blob_store
from gpushare.catalog.blob_download import LayerProgress
from gpushare.catalog.blob_store import DigestMismatch, StoreError
from gpushare.catalog.low_priority import run_low
from gpushare.catalog.ollama_store import FOLDER_MEDIA_TYPE as FOLDER_MEDIA
from gpushare.catalog.pull_child import download_files
from gpushare.catalog.registry_client import (Remote, RegistryError, error_detail, get_on_origin, read_capped)

ALLOWED = ("*.safetensors", "model.safetensors.index.json", "config.json", "generation_config.json",
           "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
           "merges.txt", "chat_template.jinja", "chat_template.json")
FILE_MEDIA = "application/vnd.gpushare.file"
TITLE = "org.opencontainers.image.title"
COMMIT = re.compile(r"[0-9a-f]{40}")  # a git commit, as the Hub names a revision it resolved
FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")  # one plain name: no `/`, no leading `.`
LFS_SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_LISTING_BYTES = 16 << 20  # a repo of thousands of files lists in a few megabytes
MAX_FILES = 1024


def _wanted(siblings: list, where: str) -> list[tuple[str, int, str | None]]:
    """(name, size, "sha256:<hex>" or None) of the files loading needs, each checked: a name that is not
    a plain name, a size that is not a byte count or a SHA-256 that is not 64 hex digits refuses the pull."""
    out = []
    for s in siblings:
        name = s.get("rfilename") if isinstance(s, dict) else None
        if not isinstance(name, str) or "/" in name or not any(fnmatch.fnmatch(name, p) for p in ALLOWED):
            continue
        if not FILE_NAME.fullmatch(name) or ".." in name:
            raise RegistryError(f"{where} lists a file named {name[:100]!r}: not a plain file name, refused")
        lfs = s.get("lfs") if isinstance(s.get("lfs"), dict) else {}
        size = s.get("size") if s.get("size") is not None else lfs.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise RegistryError(f"{where} lists {name} with size {str(size)[:40]!r}, not a byte count: refused")
        sha = lfs.get("sha256")
        if sha is not None and not (isinstance(sha, str) and LFS_SHA256.fullmatch(sha)):
            raise RegistryError(f"{where} lists {name} with SHA-256 {str(sha)[:100]!r}: refused")
        out.append((name, size, f"sha256:{sha}" if sha else None))
    return out


async def _list_files(remote: Remote, not_gguf: RegistryError) -> tuple[str, list]:
    """The commit and the wanted files of the repo at the name's tag (latest: the default branch)."""
    name = remote.name
    url = f"{name.base_url}/api/models/{name.repository}"
    if name.tag != "latest":
        url += f"/revision/{quote(name.tag, safe='')}"
    response = await get_on_origin(remote, url + "?blobs=true")
    async with response:
        if response.status != 200:
            detail = await error_detail(response)
            status = response.status if 400 <= response.status < 500 else 502
            raise RegistryError(f"{not_gguf}; and as a Hugging Face repo: {url} answered {response.status}"
                                + (f" ({detail})" if detail else ""), status)
        body = await read_capped(response, MAX_LISTING_BYTES, f"the listing at {url}", "a listing")
    try:
        doc = json.loads(body)
    except ValueError:
        raise RegistryError(f"the listing at {url} is not JSON") from None
    sha, siblings = (doc.get("sha"), doc.get("siblings")) if isinstance(doc, dict) else (None, None)
    if not isinstance(sha, str) or not COMMIT.fullmatch(sha):
        raise RegistryError(f"the listing at {url} names the commit {str(sha)[:100]!r}, not 40 hex digits: refused")
    if not isinstance(siblings, list):
        raise RegistryError(f"the listing at {url} has no list of files")
    files = _wanted(siblings, f"the listing at {url}")
    names = {f for f, _, _ in files}
    if len(files) > MAX_FILES:
        raise RegistryError(f"the listing at {url} has {len(files)} files to fetch, over {MAX_FILES}")
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        raise RegistryError(f"{not_gguf}; and {name.repository} at {name.base_url} has no GGUF for this tag nor "
                            f"config.json with *.safetensors", not_gguf.status)
    return sha, files


def _staging(root: Path, name, commit: str) -> Path:
    """The pull's staging folder, resolved: StoreError if it is not inside the store (it is rmtree'd)."""
    partial = (root / ".hf-partial").resolve()
    staging = partial / f"{name.namespace}--{name.model}--{commit}"
    if staging.parent != partial or staging.name in (".", ".."):
        raise StoreError(f"the staging folder {staging} would be outside {partial}: refused")
    staging.mkdir(parents=True, exist_ok=True)
    if staging.resolve() != staging:  # a link planted in its place
        raise StoreError(f"the staging folder {staging} is a link: refused")
    return staging


def _store_file(root: Path, path: Path, expected: str | None) -> str:
    """Move a fetched file into blobs by its SHA-256 (checked against the Hub's); returns the digest."""
    digest = blob_store.file_sha256(path)
    if expected and digest != expected:
        path.unlink()
        raise DigestMismatch(f"{path.name} arrived with SHA-256 {digest}, the Hub lists {expected}: refused, "
                             f"and nothing of it was kept")
    target = blob_store.blob_path(root, digest)
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(path, target)
    return digest


async def pull_folder(pull, root: Path, remote: Remote, not_gguf: RegistryError, cap_of, fetching) -> None:
    """The repo into the store; ``fetching`` (pull.Fetching) keeps a second pull of the same commit
    (another tag naming it) out of the staging folder until the first is done with it."""
    revision, files = await _list_files(Remote(pull.name, remote.session), not_gguf)
    sizes = {f: size for f, size, _ in files}
    expected = {f: sha for f, _, sha in files}
    blob_store.check_free_space(root, sum(sizes.values()))
    pull.layers = [LayerProgress(expected[f] or f, sizes[f]) for f, _, _ in files]
    pull.step("downloading")
    pull.mark_checked()
    async with fetching.alone(_staging(root, pull.name, revision)):
        staging = _staging(root, pull.name, revision)  # again: the pull before may have removed it
        base = f"{pull.name.base_url}/{pull.name.repository}/resolve/{revision}/"
        digests, todo = {}, []
        for (f, size, sha), layer in zip(files, pull.layers):
            if sha and blob_store.has_blob(root, sha, size):  # in the store already (that pull's, or a model's)
                digests[f], layer.completed = sha, size
            else:
                todo.append((base + quote(f), staging / f, layer))
        await download_files(pull.name, todo, cap_of)
        pull.step("verifying sha256 digest")
        for f, _, sha in files:
            if f not in digests:
                digests[f] = await run_low(_store_file, root, staging / f, sha)
        shutil.rmtree(staging)
    pull.step("writing manifest")
    config = json.dumps({"model_format": "safetensors", "repository": pull.name.repository,
                         "revision": revision, "files": digests}, sort_keys=True).encode()
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    blob_store.put_blob(root, config_digest, config)
    blob_store.link_folder(root, config_digest, digests)
    layers = [{"mediaType": FILE_MEDIA, "digest": digest, "size": sizes[f], "annotations": {TITLE: f}}
              for f, digest in digests.items()]
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": FOLDER_MEDIA, "digest": config_digest, "size": len(config)},
                "layers": layers}
    blob_store.write_manifest(root, pull.name.parts, json.dumps(manifest).encode())
