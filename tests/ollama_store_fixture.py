"""An Ollama model store laid out as `ollama pull` / `ollama create` leave it, for the tests.

``root/manifests/<registry>/<namespace>/<name>/<tag>`` is a Docker v2 manifest whose layers
(mediaType application/vnd.ollama.image.model, .params, .system, .template, .license,
.messages) name blobs stored as ``root/blobs/sha256-<hex>`` by their content's SHA-256.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MEDIA = "application/vnd.ollama.image."


def add_blob(root: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    blob = root / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    if not blob.exists():
        blob.write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def add_model(root: Path, name: str, tag: str, gguf: bytes, layers: dict[str, bytes | str | dict | list],
              registry: str = "registry.ollama.ai", namespace: str = "library") -> Path:
    """Write one manifest; ``layers`` maps a layer kind (params, system, template, license, messages) to its
    content (a dict or list is written as JSON). Returns the manifest's path."""
    out = [{"mediaType": MEDIA + "model", **add_blob(root, gguf)}]
    for kind, content in layers.items():
        data = json.dumps(content).encode() if isinstance(content, (dict, list)) else \
            content.encode() if isinstance(content, str) else content
        out.append({"mediaType": MEDIA + kind, **add_blob(root, data)})
    config = add_blob(root, json.dumps({"model_format": "gguf", "model_family": "llama"}).encode())
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json", **config}, "layers": out}
    path = root / "manifests" / registry / namespace / name / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return path


def tree_digest(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every file and folder under root with its mode, mtime and (files) content hash: equal before and
    after means nothing was written, removed, touched or chmod-ed."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            content = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
            state[str(path.relative_to(root))] = (st.st_mode, st.st_mtime_ns, content)
    return state
