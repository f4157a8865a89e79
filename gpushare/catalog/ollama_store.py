"""Ollama's model store as a model source, read-only: what `ollama pull` and `ollama create` left.

A store (`$OLLAMA_MODELS`, `~/.ollama/models`, the system service's
`/usr/share/ollama/.ollama/models`; the `ollama_models` setting) holds
``manifests/<registry>/<namespace>/<name>/<tag>`` JSON files whose layers name blobs
``blobs/sha256-<hex>``. A model is its manifest: the `application/vnd.ollama.image.model`
layer is the GGUF, `.params` (JSON options), `.system`, `.messages` (JSON) and `.license`
layers become its ModelPreset. A `.template` layer is Ollama's Go template, which this
engine does not run: the GGUF's own Jinja chat template is used instead. A model with an
`.adapter` layer (a GGUF LoRA) is that adapter served on its model layer's weights (the model
of the same blob, model_catalog.link_adapters).

Names are as `ollama list` prints them: `name:tag` for registry.ollama.ai/library,
`namespace/name:tag` for another namespace there, `host/namespace/name:tag` elsewhere.
A broken manifest (bad JSON, a missing blob, a bad params layer) is logged once, naming
the file and line, and skipped; the other models still list. Nothing here ever writes.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from gpushare.settings.model_options import OPTION_TYPES, ModelPreset, OptionError, messages_from_json, options_from_json

log = logging.getLogger("gpushare.registry")

DEFAULT_REGISTRY = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
MEDIA_TYPE = "application/vnd.ollama.image."
FOLDER_MEDIA_TYPE = "application/vnd.gpushare.folder.v1+json"  # an HF folder pulled (catalog/hf_pull.py)
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
SKIPPED_LAYERS = {"template": "Go template: the GGUF's own chat template is used",
                  "projector": "vision projector: text only"}


class StoreError(ValueError):
    """A manifest that cannot be served; the message names the file (and line) at fault."""


def model_name(relative: Path) -> str:
    """`registry/namespace/name/tag` (a manifest's path under manifests/) as `ollama list` shows it."""
    registry, namespace, name, tag = relative.parts
    if registry == DEFAULT_REGISTRY:
        return f"{name}:{tag}" if namespace == DEFAULT_NAMESPACE else f"{namespace}/{name}:{tag}"
    return f"{registry}/{namespace}/{name}:{tag}"


def blob_path(root: Path, digest: str) -> Path:
    """The blob a layer's digest names; only ``sha256:<64 hex>`` digests are taken: a digest is used as a
    file name, and ``../`` or an absolute one would name any file on the node."""
    if not DIGEST.fullmatch(digest):
        raise StoreError(f"a layer's digest {digest[:80]!r} is not sha256:<64 hex digits>")
    return root / "blobs" / digest.replace(":", "-")


def _read_text(path: Path, manifest: Path, what: str, limit_bytes: int = 1 << 20) -> str:
    if not path.is_file():
        raise StoreError(f"{manifest}: the {what} layer's blob is missing: {path}")
    if path.stat().st_size > limit_bytes:
        raise StoreError(f"{path}: the {what} layer is over {limit_bytes} bytes")
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise StoreError(f"{path}: cannot read the {what} layer: {e}") from None


def _read_json(path: Path, text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise StoreError(f"{path}:{e.lineno}: not valid JSON (column {e.colno}: {e.msg})") from None


def read_manifest(root: Path, manifest: Path) -> tuple[str, str, ModelPreset, str | None]:
    """(GGUF blob path, its sha256 hex, preset, the adapter layer's blob path or None) of one manifest; raises
    StoreError naming the file at fault."""
    doc = _read_json(manifest, _read_text(manifest, manifest, "manifest"))
    layers = doc.get("layers") if isinstance(doc, dict) else None
    if not isinstance(layers, list) or not all(isinstance(x, dict) and isinstance(x.get("digest"), str)
                                               and isinstance(x.get("mediaType"), str) for x in layers):
        raise StoreError(f"{manifest}: not an Ollama manifest (no \"layers\" list of {{mediaType, digest}})")
    config = doc.get("config")
    if isinstance(config, dict) and config.get("mediaType") == FOLDER_MEDIA_TYPE:
        folder = root / "folders" / str(config.get("digest")).replace(":", "-")
        if folder.parent != root / "folders" or not (folder / "config.json").is_file():
            raise StoreError(f"{manifest}: the model's folder is missing: {folder}")
        return str(folder), folder.name.removeprefix("sha256-"), ModelPreset(), None
    model, preset, adapter = None, ModelPreset(), None
    for layer in layers:
        kind = layer["mediaType"].removeprefix(MEDIA_TYPE)
        if not DIGEST.fullmatch(layer["digest"]):
            raise StoreError(f"{manifest}: a layer's digest {layer['digest'][:80]!r} is not sha256:<64 hex digits>")
        blob = blob_path(root, layer["digest"])
        try:
            if kind == "model":
                if not blob.is_file():
                    raise StoreError(f"{manifest}: the model layer's blob is missing: {blob}")
                model = blob
            elif kind == "params":
                params = _read_json(blob, _read_text(blob, manifest, "params"))
                if isinstance(params, dict):  # a newer Ollama's option this one does not know: not worth the model
                    for name in [k for k in params if k not in OPTION_TYPES]:
                        log.warning("Ollama store: %s: ignoring the unknown parameter %r", blob, name)
                        del params[name]
                preset.options = options_from_json(params, str(blob))
            elif kind == "system":
                preset.system = _read_text(blob, manifest, "system")
            elif kind == "messages":
                preset.messages = messages_from_json(_read_json(blob, _read_text(blob, manifest, "messages")),
                                                     str(blob))
            elif kind == "license":
                text = _read_text(blob, manifest, "license")
                preset.license = text if preset.license is None else f"{preset.license}\n{text}"
            elif kind == "adapter":
                if adapter is not None or not blob.is_file():
                    raise StoreError(f"{manifest}: the adapter layer's blob is missing ({blob}), or there are "
                                     f"several adapter layers (one is served)")
                adapter = str(blob)
        except OptionError as e:
            raise StoreError(str(e)) from None
    if model is None:
        raise StoreError(f"{manifest}: no {MEDIA_TYPE}model layer (a GGUF)")
    return str(model), model.name.removeprefix("sha256-"), preset, adapter


# manifest path -> ((mtime_ns, size), result): a listing reads each manifest once until it changes,
# and a broken one is logged once, not on every request.
_cache: dict[Path, tuple[tuple, object]] = {}


def scan_store(root: Path) -> list[tuple[str, Path, str, str, ModelPreset, str | None]]:
    """(name, manifest, GGUF path, sha256 hex, preset, adapter path or None) of every servable model in one store."""
    manifests_dir = root / "manifests"
    if not manifests_dir.is_dir():
        return []
    found = []
    for dirpath, dirnames, filenames in os.walk(manifests_dir):
        dirnames.sort()
        for filename in sorted(filenames):
            manifest = Path(dirpath) / filename
            relative = manifest.relative_to(manifests_dir)
            if len(relative.parts) != 4 or filename.startswith("."):
                continue
            try:
                st = manifest.stat()
            except OSError:
                continue
            stamp = (st.st_mtime_ns, st.st_size)
            cached = _cache.get(manifest)
            if cached is None or cached[0] != stamp:
                try:
                    result = read_manifest(root, manifest)
                except StoreError as e:
                    log.warning("Ollama store: skipping %s: %s", model_name(relative), e)
                    result = e
                cached = _cache[manifest] = (stamp, result)
            if not isinstance(cached[1], StoreError):
                found.append((model_name(relative), manifest, *cached[1]))
    return found


def store_problems(root: Path) -> list[str]:
    """Why each manifest of `root` that the last listing skipped was skipped."""
    return [str(result) for path, (_, result) in sorted(_cache.items())
            if isinstance(result, StoreError) and path.is_relative_to(root) and path.exists()]
