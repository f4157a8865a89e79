"""A Hugging Face repo of safetensors (no GGUF) pulled through huggingface_hub into the store, as a folder.

Only what loading needs is fetched (ALLOWED: weights, config, tokenizer, chat template),
one file at a time by `hf_hub_download` into a staging folder under the store (it resumes
a cut file itself). Each file's SHA-256 is checked against the one the Hub lists for
LFS files, then the file becomes a blob; the folder is `folders/<config digest>/` with a
link per file, and the manifest names the files as layers of FILE_MEDIA and the folder by
its config blob of FOLDER_MEDIA (ollama_store.read_manifest serves it as an HF folder).
"""

from __future__ import annotations

import asyncio
import fnmatch
import hashlib
import json
import os
import shutil
from pathlib import Path

from gpushare.catalog import blob_store
from gpushare.catalog.blob_download import LayerProgress
from gpushare.catalog.blob_store import DigestMismatch
from gpushare.catalog.low_priority import run_low
from gpushare.catalog.registry_client import RegistryError
from gpushare.catalog.ollama_store import FOLDER_MEDIA_TYPE as FOLDER_MEDIA

ALLOWED = ("*.safetensors", "model.safetensors.index.json", "config.json", "generation_config.json",
           "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
           "merges.txt", "chat_template.jinja", "chat_template.json")
FILE_MEDIA = "application/vnd.gpushare.file"
TITLE = "org.opencontainers.image.title"
POLL_S = 0.25


def _wanted(siblings) -> list:
    return [s for s in siblings if "/" not in s.rfilename and any(fnmatch.fnmatch(s.rfilename, p) for p in ALLOWED)]


async def _list_files(pull, not_gguf: RegistryError):
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    name = pull.name
    api = HfApi(endpoint=name.base_url, token=name.token or False)
    revision = None if name.tag == "latest" else name.tag
    try:
        info = await asyncio.to_thread(api.model_info, name.repository, revision=revision, files_metadata=True)
    except (HfHubHTTPError, OSError) as e:
        raise RegistryError(f"{not_gguf}; and as a Hugging Face repo: {e}", getattr(
            getattr(e, "response", None), "status_code", 404) or 404) from None
    files = _wanted(info.siblings or [])
    names = {s.rfilename for s in files}
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        raise RegistryError(f"{not_gguf}; and {name.repository} at {name.base_url} has no GGUF for this tag nor "
                            f"config.json with *.safetensors", not_gguf.status)
    return info.sha, files


async def _fetch_file(pull, staging: Path, revision: str, sibling, layer: LayerProgress) -> Path:
    from huggingface_hub import hf_hub_download

    name = pull.name
    job = asyncio.ensure_future(run_low(
        hf_hub_download, name.repository, sibling.rfilename, revision=revision, endpoint=name.base_url,
        token=name.token or False, local_dir=staging))
    incomplete = staging / ".cache" / "huggingface" / "download"
    while not job.done():  # huggingface_hub writes into <...>.incomplete first: its size is the progress
        sizes = [p.stat().st_size for p in incomplete.glob("*.incomplete")] if incomplete.is_dir() else []
        layer.completed = min(max(sizes, default=layer.completed), layer.total)
        await asyncio.wait({job}, timeout=POLL_S)
    path = Path(job.result())
    layer.completed = layer.total = path.stat().st_size
    return path


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


async def pull_folder(pull, root: Path, not_gguf: RegistryError) -> None:
    revision, files = await _list_files(pull, not_gguf)
    sizes = {s.rfilename: (s.size or (s.lfs.size if s.lfs else 0) or 0) for s in files}
    expected = {s.rfilename: f"sha256:{s.lfs.sha256}" if s.lfs and s.lfs.sha256 else None for s in files}
    blob_store.check_free_space(root, sum(sizes.values()))
    pull.layers = [LayerProgress(expected[s.rfilename] or s.rfilename, sizes[s.rfilename]) for s in files]
    pull.step("downloading")
    pull.checked.set()
    staging = root / ".hf-partial" / f"{pull.name.namespace}--{pull.name.model}--{revision}"
    fetched = {}
    for sibling, layer in zip(files, pull.layers):
        fetched[sibling.rfilename] = await _fetch_file(pull, staging, revision, sibling, layer)
    pull.step("verifying sha256 digest")
    digests = {}
    for filename, path in fetched.items():
        digests[filename] = await run_low(_store_file, root, path, expected[filename])
    pull.step("writing manifest")
    config = json.dumps({"model_format": "safetensors", "repository": pull.name.repository,
                         "revision": revision, "files": digests}, sort_keys=True).encode()
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    blob_store.put_blob(root, config_digest, config)
    blob_store.link_folder(root, config_digest, digests)
    layers = [{"mediaType": FILE_MEDIA, "digest": digest, "size": sizes[f] or blob_store.blob_path(
        root, digest).stat().st_size, "annotations": {TITLE: f}} for f, digest in digests.items()]
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": FOLDER_MEDIA, "digest": config_digest, "size": len(config)},
                "layers": layers}
    blob_store.write_manifest(root, pull.name.parts, json.dumps(manifest).encode())
    shutil.rmtree(staging, ignore_errors=True)
