"""gpushare's content-addressed store in models_dir: blobs by SHA-256, manifests by name, nothing half-written.

The layout is Ollama's (`blobs/sha256-<hex>`, `manifests/<host>/<namespace>/<name>/<tag>`),
so the store's models list as Ollama's do (catalog reads it with ollama_store.scan_store)
and a blob is shared by every model that names it. A blob being fetched is
`blobs/sha256-<hex>-partial` beside `...-partial.json`, which records how much of each range
is written: a pull that was cut, or a daemon that restarted, goes on from there. A partial
becomes the blob only once its SHA-256 is the digest; otherwise it is deleted. A Hugging Face
folder (config.json, safetensors, tokenizer) is its files' blobs plus `folders/sha256-<hex>/`,
named by the manifest's config blob, whose entries link to them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
HASH_CHUNK_BYTES = 4 << 20
DISK_MARGIN_BYTES = 64 << 20  # left free for the manifest, logs and whatever else shares the disk
TEST_FREE_DISK_ENV = "GPUSHARE_TEST_FREE_DISK_BYTES"


class StoreError(ValueError):
    """A store operation that cannot go on; the message says why (and, for space, how much)."""


class DigestMismatch(StoreError):
    pass


def check_digest(digest: object) -> str:
    """`digest` if it is `sha256:` and 64 lowercase hex digits (never a path: no `/`, no `..`)."""
    if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
        raise StoreError(f"invalid digest {str(digest)[:100]!r}: expected sha256:<64 hex digits>")
    return digest


def blob_path(root: Path, digest: str) -> Path:
    return root / "blobs" / check_digest(digest).replace(":", "-")


def partial_path(root: Path, digest: str) -> Path:
    return blob_path(root, digest).with_name(blob_path(root, digest).name + "-partial")


def manifest_path(root: Path, parts: tuple[str, str, str, str]) -> Path:
    return root.joinpath("manifests", *parts)


def folder_path(root: Path, config_digest: str) -> Path:
    return root / "folders" / check_digest(config_digest).replace(":", "-")


def has_blob(root: Path, digest: str, size: int) -> bool:
    path = blob_path(root, digest)
    return path.is_file() and path.stat().st_size == size


@dataclass
class Partial:
    """What is on disk of one blob being fetched: ranges [start, end) and the bytes written of each."""
    size: int
    ranges: list[list[int]] = field(default_factory=list)  # [start, end, written]

    @property
    def written(self) -> int:
        return sum(r[2] for r in self.ranges)


def read_partial(root: Path, digest: str, size: int) -> Partial | None:
    """The partial left by an earlier try, if it is of this size and its data file is there."""
    state = partial_path(root, digest).with_suffix(".json")
    try:
        doc = json.loads(state.read_text())
        partial = Partial(int(doc["size"]), [[int(a), int(b), int(c)] for a, b, c in doc["ranges"]])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    sane = all(0 <= a <= a + c <= b <= partial.size for a, b, c in partial.ranges)
    if partial.size != size or not sane or not partial_path(root, digest).is_file():
        return None
    return partial


def save_partial(root: Path, digest: str, partial: Partial) -> None:
    state = partial_path(root, digest).with_suffix(".json")
    tmp = state.with_name(state.name + ".tmp")
    tmp.write_text(json.dumps({"size": partial.size, "ranges": partial.ranges}))
    os.replace(tmp, state)


def discard_partial(root: Path, digest: str) -> None:
    path = partial_path(root, digest)
    for p in (path, path.with_suffix(".json"), path.with_suffix(".json").with_name(path.name + ".json.tmp")):
        p.unlink(missing_ok=True)


def open_partial(root: Path, digest: str, size: int) -> int:
    """A file descriptor on the partial data file, `size` bytes long (created if missing)."""
    path = partial_path(root, digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)
    except OSError:
        os.close(fd)
        raise
    return fd


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def commit_partial(root: Path, digest: str) -> None:
    """Verify the partial's SHA-256 and make it the blob; on a mismatch delete it and raise (blocking: a thread)."""
    path = partial_path(root, digest)
    actual = file_sha256(path)
    if actual != digest:
        discard_partial(root, digest)
        raise DigestMismatch(f"blob {digest} arrived with SHA-256 {actual}: refused, and nothing of it was kept")
    os.replace(path, blob_path(root, digest))
    discard_partial(root, digest)


def put_blob(root: Path, digest: str, data: bytes) -> None:
    """Store bytes in hand (a small layer, an uploaded blob) under `digest`, after checking it."""
    check_digest(digest)
    if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
        raise DigestMismatch(f"the bytes given do not have the digest {digest}")
    path = blob_path(root, digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_path(root, digest)
    tmp.write_bytes(data)
    os.replace(tmp, path)


def free_disk_bytes(root: Path) -> int:
    """The bytes free on `root`'s disk. TEST ONLY: GPUSHARE_TEST_FREE_DISK_BYTES=N in the environment
    makes it at most N (a disk near full, faked at the disk's boundary); unset, the disk's own figure."""
    free = shutil.disk_usage(root).free
    fake = os.environ.get(TEST_FREE_DISK_ENV)
    return min(free, int(fake)) if fake else free


def check_free_space(root: Path, needed_bytes: int, free_bytes: int | None = None, what: str = "this pull") -> int:
    """The bytes free; StoreError naming the space needed and free when `needed_bytes` (plus a margin) does
    not fit. `free_bytes`: what was free when a write of unknown length began (an upload checked as it grows)."""
    root.mkdir(parents=True, exist_ok=True)
    free = free_disk_bytes(root) if free_bytes is None else free_bytes
    if needed_bytes + DISK_MARGIN_BYTES > free:
        raise StoreError(f"not enough disk space in {root}: {what} needs {needed_bytes} bytes "
                         f"({_human(needed_bytes)}) plus {_human(DISK_MARGIN_BYTES)} to spare, "
                         f"and {free} bytes ({_human(free)}) are free")
    return free


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


def write_manifest(root: Path, parts: tuple[str, str, str, str], manifest: bytes) -> Path:
    """Write a manifest whole (a listing never sees half of one)."""
    path = manifest_path(root, parts)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(manifest)
    os.replace(tmp, path)
    return path


def link_folder(root: Path, config_digest: str, files: dict[str, str]) -> Path:
    """`folders/<config digest>/` with one link per file (name -> its blob): an HF folder the loader reads."""
    folder = folder_path(root, config_digest)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, digest in files.items():
        target = tmp / name
        target.parent.mkdir(parents=True, exist_ok=True)
        depth = len(Path(name).parts) + 1  # folders/<digest>/[subdirs/]name -> root
        target.symlink_to(Path(*([".."] * depth)) / "blobs" / check_digest(digest).replace(":", "-"))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


def manifest_digests(path: Path) -> set[str]:
    """The config and layer digests one manifest names (none if it cannot be read)."""
    try:
        doc = json.loads(path.read_text())
        entries = [doc.get("config") or {}, *doc.get("layers", [])]
        return {e["digest"] for e in entries if isinstance(e, dict) and isinstance(e.get("digest"), str)}
    except (OSError, ValueError, AttributeError):
        return set()


def drop_unused(root: Path, keep_paths: set[Path]) -> list[str]:
    """Delete the blobs and folders no manifest names (every layer: model, adapter, projector, params...)
    and no path in `keep_paths` is, holds or is inside (a kept folder keeps the blobs its links name);
    returns what went. Partials (a pull under way or to resume) stay."""
    used: set[str] = set()
    manifests = root / "manifests"
    if manifests.is_dir():
        for dirpath, _, filenames in os.walk(manifests):
            for name in filenames:
                if not name.startswith("."):
                    used |= manifest_digests(Path(dirpath) / name)
    kept = {p.resolve() for p in keep_paths}
    for path in [p for p in kept if p.is_dir()]:
        kept |= {(Path(d) / f).resolve() for d, _, files in os.walk(path) for f in files}
    kept |= {parent for p in list(kept) for parent in p.parents}
    removed = []
    for kind in ("folders", "blobs"):
        folder = root / kind
        if not folder.is_dir():
            continue
        for p in sorted(folder.iterdir()):
            digest = p.name.replace("-", ":", 1)
            if not DIGEST.fullmatch(digest) or digest in used or p.resolve() in kept:
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
            removed.append(f"{kind}/{p.name}")
    return removed
