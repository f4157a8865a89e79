"""Opening a model's files as data from strangers: regular files only, never through a link that leaves
the model's folder.

A model folder is written by whoever published or copied it. A ``chat_template.jinja`` that is a
symlink to ``/etc/shadow`` would otherwise be read and shown by ``/api/show``; a ``*.safetensors``
that is a FIFO would block the thread reading it for ever (an open of a FIFO waits for a writer).
So every file of a folder is resolved and must stay inside the folder's real path (or, for a Hugging
Face cache snapshot, inside its repository's cache folder, where the snapshot's links point into
``blobs/``), and is opened with O_NONBLOCK, then checked with fstat to be a regular file before a
byte is read. Errors name the file by its name in the folder, never the link's target.
``without_paths`` turns a load error into what a tenant may read: file names, no node paths.
Torch-free: the supervisor (residency, api) and the loaders (models) share it.
"""

from __future__ import annotations

import glob
import json
import os
import re
import stat

MAX_JSON_BYTES = 64 << 20  # a model folder's JSON files (tokenizer.json of a 256k vocabulary is ~35 MB)
MAX_TEXT_BYTES = 1 << 20  # a chat_template.jinja


class ModelFileError(ValueError):
    """A model file that is refused: a link leaving the folder, not a regular file, or too large."""


def _allowed_root(folder_real: str) -> str:
    """The folder links may point into: the folder, a Hugging Face cache repository
    (``models--org--name/snapshots/<rev>`` links to ``models--org--name/blobs/``), or the store a pull
    wrote (``folders/sha256-<hex>/`` links to the same store's ``blobs/``: catalog/blob_store.py;
    only an admin pulls)."""
    parent = os.path.dirname(folder_real)
    if os.path.basename(parent) == "snapshots" and os.path.basename(os.path.dirname(parent)).startswith("models--"):
        return os.path.dirname(parent)
    if os.path.basename(parent) == "folders" and re.fullmatch(r"sha256-[0-9a-f]{64}", os.path.basename(folder_real)) \
            and os.path.isdir(os.path.join(os.path.dirname(parent), "blobs")):
        return os.path.dirname(parent)  # the store: the folder's own links and the blobs they name
    return folder_real


def checked_path(folder: str, name: str) -> str | None:
    """The real path of ``folder/name`` (None when absent); ModelFileError when it leaves the folder."""
    path = os.path.join(folder, name)
    if not os.path.lexists(path):
        return None
    root = _allowed_root(os.path.realpath(folder))
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise ModelFileError(f"{name} is a symbolic link that leaves the model's folder: refused")
    if not os.path.exists(real):
        return None
    return real


def open_regular(path: str, name: str | None = None):
    """``path`` opened for binary reading when it is a regular file (the open never waits: O_NONBLOCK),
    else ModelFileError naming it by ``name`` (default: its file name)."""
    shown = name or os.path.basename(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ModelFileError(f"{shown} is not a regular file (a FIFO, device or socket): refused")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(folder: str, name: str, limit_bytes: int) -> bytes | None:
    """The bytes of ``folder/name`` (None when absent), at most ``limit_bytes`` (ModelFileError beyond)."""
    real = checked_path(folder, name)
    if real is None:
        return None
    with open_regular(real, name) as f:
        data = f.read(limit_bytes + 1)
    if len(data) > limit_bytes:
        raise ModelFileError(f"{name} is over {limit_bytes} bytes, the most a model's {name} may hold")
    return data


def read_text(folder: str, name: str, limit_bytes: int = MAX_TEXT_BYTES) -> str | None:
    data = read_bytes(folder, name, limit_bytes)
    return None if data is None else data.decode("utf-8")


def read_json(folder: str, name: str, default=None, limit_bytes: int = MAX_JSON_BYTES):
    """``folder/name`` parsed as JSON; ``default`` when the file is absent."""
    data = read_bytes(folder, name, limit_bytes)
    if data is None:
        return default
    try:
        return json.loads(data)
    except ValueError as e:
        raise ModelFileError(f"{name} is not valid JSON ({e})") from None


def weight_files(folder: str, pattern: str = "*.safetensors") -> list[str]:
    """The checked real paths of the folder's files matching ``pattern``, sorted by name; each a regular
    file inside the folder (ModelFileError naming the first that is not)."""
    paths = []
    for path in sorted(glob.glob(os.path.join(glob.escape(folder), pattern))):
        name = os.path.basename(path)
        real = checked_path(folder, name)
        if real is None:
            continue
        if not stat.S_ISREG(os.stat(real).st_mode):
            raise ModelFileError(f"{name} is not a regular file (a FIFO, device or socket): refused")
        paths.append(real)
    return paths


def without_paths(message: str, path: str) -> str:
    """A load error as a tenant sees it: the model's file or folder by its name, never where the node
    keeps it (the full message goes to the log)."""
    real = os.path.realpath(path)
    for p in sorted({path, real} - {"", os.sep}, key=len, reverse=True):
        message = message.replace(p, os.path.basename(p.rstrip(os.sep)))
    for folder in sorted({os.path.dirname(path), os.path.dirname(real)} - {"", os.sep}, key=len, reverse=True):
        message = message.replace(folder + os.sep, "")
    return message
