"""What models exist and what they are: config entries, the models_dir scan, Ollama's store, descriptions.

Models come from the config's `models` list, from a scan of `models_dir` (every ``*.gguf``
file, every folder holding a config.json, every ``NAME.modelfile`` that `gpushare create -f`
wrote), from the models gpushare pulled into models_dir (catalog/pull.py: Ollama's store
layout) and from Ollama's model stores (catalog/ollama_store.py); on a name clash the config
wins, then models_dir's files, then the pulled models, then Ollama's stores in order. Each
carries a ModelPreset (its default options, system prompt, template). A description (what
/api/show and /api/tags tell) is read from the files without the weights, or from the loaded
model.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from gpushare.settings.settings import Settings
from gpushare.catalog.ollama_store import scan_store, store_problems
from gpushare.settings.model_options import ModelPreset
from gpushare.catalog.modelfile import ModelfileError, parse_modelfile

log = logging.getLogger("gpushare.registry")
MODELFILE_SUFFIX = ".modelfile"


class ModelNotFound(KeyError):
    def __str__(self) -> str:
        return self.args[0]


class RegistrationError(ValueError):
    """`create`, `remove` or `unload` refused: a bad name or path, a model the config defines or pins."""


@dataclass
class ModelSource:
    name: str
    path: str
    keep_alive_s: float | None = None  # None: the server default
    origin: str = "config"  # "config" | "models_dir" | "pulled" (gpushare's store) | "ollama" (Ollama's)
    pinned: bool = False  # never evicted nor unloaded
    preload: bool = False  # loaded at daemon start
    weight: float = 1.0  # share of engine steps when several models are busy
    weights: str | None = None  # weight format (models[].weights); None: engine.weights
    preset: ModelPreset = field(default_factory=ModelPreset)  # default options, system prompt, template
    definition: str | None = None  # the file that defines it beside the weights: a .modelfile or a manifest
    sha256: str | None = None  # the weights' real digest when known (Ollama's blob name)
    device: str | None = None  # models[].device: the device it must load on; None: placement chooses
    replicas: int = 1  # models[].replicas: copies on as many devices
    adapter: str | None = None  # a LoRA adapter's file or folder: this model is it, served on `base`
    base: str | None = None  # the model an adapter runs on (its path is the base's weights)

    @property
    def format(self) -> str:
        return "safetensors" if os.path.isdir(self.path) else "gguf"

    def size_bytes(self) -> int:
        """Its files' bytes: an adapter's own (its base is a model of its own)."""
        path = self.adapter or self.path
        if os.path.isdir(path):
            return sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))
        return os.path.getsize(path)

    def modified_at(self) -> float:
        return os.path.getmtime(self.definition or self.adapter or self.path)

    def digest(self) -> str:
        """A stable ID from path, size and mtime (hashing multi-GB weights on every list is too slow); an
        adapter's from its own file and its base's weights, so it is never its base's."""
        if self.sha256 and self.adapter is None:
            return self.sha256
        key = f"{os.path.realpath(self.adapter or self.path)}:{self.size_bytes()}:{self.modified_at()}"
        if self.adapter is not None:
            key += f":{self.path}"
        return hashlib.sha256(key.encode()).hexdigest()


def scan_models_dir(models_dir: Path) -> list[ModelSource]:
    """*.gguf files (name: the file name without .gguf) and HF folders (name: the folder name)."""
    if not models_dir.is_dir():
        return []
    found = []
    for p in sorted(models_dir.iterdir()):
        if p.name.startswith("."):
            continue
        if p.suffix == ".gguf" and p.is_file():
            found.append(ModelSource(p.name[: -len(".gguf")], str(p), origin="models_dir"))
        elif p.is_dir() and (p / "config.json").is_file():
            found.append(ModelSource(p.name, str(p), origin="models_dir"))
        elif p.suffix == MODELFILE_SUFFIX and p.is_file():
            source = _read_created(p)
            if source is not None:
                found.append(source)
    return found


_created_cache: dict[Path, tuple[tuple, ModelSource | None]] = {}  # a broken file is logged once, not per request
_created_problems: dict[Path, str] = {}


def _read_created(path: Path) -> ModelSource | None:
    """A model `create -f` wrote: its Modelfile names the weights by absolute path."""
    st = path.stat()
    stamp = (st.st_mtime_ns, st.st_size)
    cached = _created_cache.get(path)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    source = None
    try:
        modelfile = parse_modelfile(path.read_text(), str(path))
        name = path.name[: -len(MODELFILE_SUFFIX)]
        if modelfile.adapter is not None:  # FROM names the base model (or its weights), found by link_adapters
            if not os.path.exists(modelfile.adapter):
                raise ModelfileError(f"{path}: ADAPTER {modelfile.adapter}: no such file or folder")
            source = ModelSource(name, "", origin="models_dir", preset=modelfile.preset, definition=str(path),
                                 adapter=modelfile.adapter, base=modelfile.base)
        elif not os.path.exists(modelfile.base):
            raise ModelfileError(f"{path}: FROM {modelfile.base}: no such file or folder")
        else:
            source = ModelSource(name, modelfile.base, origin="models_dir", preset=modelfile.preset,
                                 definition=str(path))
    except (ModelfileError, OSError, UnicodeDecodeError) as e:
        log.warning("models_dir: skipping %s: %s", path.name, e)
        _created_problems[path] = str(e)
    _created_cache[path] = (stamp, source)
    return source


def catalog_problems(settings: Settings) -> list[str]:
    """Why the files the last listing skipped (broken manifests, Modelfiles) were skipped."""
    created = [message for path, message in sorted(_created_problems.items())
               if path.parent == settings.models_dir and path.exists() and _created_cache[path][1] is None]
    return created + [message for root in [settings.models_dir, *settings.ollama_models]
                      for message in store_problems(root)]


def model_sources(settings: Settings) -> dict[str, ModelSource]:
    """Every available model by name: Ollama's stores, what was pulled into models_dir, the models_dir scan,
    the config's entries (last wins)."""
    found = {}
    stores = [(root, "ollama") for root in reversed(settings.ollama_models)]  # the first store named wins a clash
    for root, origin in [*stores, (settings.models_dir, "pulled")]:
        for name, manifest, path, sha256, preset, adapter in scan_store(root):
            found[name] = ModelSource(name, path, origin=origin, preset=preset, definition=str(manifest),
                                      sha256=sha256, adapter=adapter, base=path if adapter else None)
    found.update((s.name, s) for s in scan_models_dir(settings.models_dir))
    for m in settings.models:
        found[m.name] = ModelSource(m.name, m.path, m.keep_alive_s, origin="config", pinned=m.pinned,
                                    preload=m.preload, weight=m.weight, weights=m.weights,
                                    preset=ModelPreset(dict(m.options), m.system), device=m.device,
                                    replicas=m.replicas, adapter=m.adapter, base=m.base)
    link_adapters(found)
    return found


def referenced_paths(settings: Settings, sources: dict[str, ModelSource]) -> set[Path]:
    """Every file or folder a model names by path, for the store's garbage collection
    (blob_store.drop_unused; manifests count their own layers): each model's weights, adapter and
    base, the config's entries, every Modelfile and link in models_dir, those a model of the same name
    hides included (removing that model shows them again)."""
    named = [p for s in sources.values() for p in (s.path, s.adapter, s.base)]
    named += [p for m in settings.models for p in (m.path, m.adapter, m.base)]
    folder = settings.models_dir
    for p in sorted(folder.iterdir()) if folder.is_dir() else []:
        if p.is_symlink():
            named.append(str(p))
        elif p.suffix == MODELFILE_SUFFIX and p.is_file():
            try:
                modelfile = parse_modelfile(p.read_text(), str(p))
            except (ModelfileError, OSError, UnicodeDecodeError):
                continue  # unreadable: it names nothing a model can use
            named += [modelfile.base, modelfile.adapter]
    return {Path(p) for p in named if p and os.path.isabs(p)}


def link_adapters(found: dict[str, ModelSource]) -> None:
    """Give each adapter its base: a model's name (``name`` or ``name:latest``), else weights by path (an
    Ollama store's model layer, a Modelfile's FROM path), served as the model of those weights, or as
    ``<adapter>-base`` when no model has them. An adapter then describes itself by its base's weights.
    One whose base is missing or is itself an adapter stays listed with no path: it fails when used."""
    for source in [s for s in found.values() if s.adapter is not None]:
        base = found.get(source.base) or found.get(f"{source.base}:latest")
        if base is None and os.path.exists(source.base):
            real = os.path.realpath(source.base)
            base = next((s for s in found.values() if s.adapter is None and s.path
                         and os.path.realpath(s.path) == real), None)
            if base is None:
                base = found[f"{source.name}-base"] = ModelSource(f"{source.name}-base", source.base,
                                                                  origin=source.origin, sha256=source.sha256)
        if base is not None and base.adapter is None:
            source.base, source.path = base.name, base.path
            source.preset = source.preset.over(base.preset)


@dataclass
class ModelDescription:
    """What /api/show and /api/tags tell about a model, read from its files or its loaded form."""
    details: dict  # Ollama's details: format, family, families, parameter_size, quantization_level
    model_info: dict  # GGUF-style keys: general.architecture, <arch>.context_length, ...
    template: str | None
    context_length: int
    source_types: frozenset = frozenset()  # GGUF type names of the matrices (weight_format.resolve_weights)
    kind: str = "chat"  # what it serves: chat (and embeddings), embedding, rerank (LoadedModel.kind)

    @property
    def capabilities(self) -> list[str]:
        """Ollama's /api/show capabilities: a chat model completes, calls tools and embeds (mean-pooled
        hidden states); an embedding model embeds; a reranker reranks."""
        return {"chat": ["completion", "tools", "embedding"], "embedding": ["embedding"],
                "rerank": ["rerank"]}[self.kind]


def describe_model(config, template: str | None, info: dict, parameter_count: int | None) -> ModelDescription:
    arch = config.arch
    model_info = {
        "general.architecture": arch,
        f"{arch}.context_length": config.context_length,
        f"{arch}.embedding_length": config.hidden_size,
        f"{arch}.feed_forward_length": config.intermediate_size,
        f"{arch}.block_count": config.num_layers,
        f"{arch}.attention.head_count": config.num_heads,
        f"{arch}.attention.head_count_kv": config.num_kv_heads,
        f"{arch}.vocab_size": config.vocab_size,
        f"{arch}.rope.freq_base": config.rope_theta,
    }
    if parameter_count:
        model_info["general.parameter_count"] = parameter_count
    size_label = info.get("parameter_size") or (_size_label(parameter_count) if parameter_count else "")
    kind = info.get("kind", "chat")
    # kind: gpushare's, beside Ollama's details (chat | embedding | rerank)
    details = {"parent_model": "", "format": info.get("format", ""), "family": arch, "families": [arch],
               "parameter_size": size_label, "quantization_level": info.get("quantization_level") or "", "kind": kind}
    if getattr(config, "is_encoder", False) and not config.rotary:
        model_info.pop(f"{arch}.rope.freq_base")  # learned positions
    return ModelDescription(details, model_info, template, config.context_length,
                            frozenset(info.get("source_types", ())), kind)


def _size_label(count: int) -> str:
    return f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.0f}M"


def describe_files(path: str) -> ModelDescription:
    """Read only what describes the model (no weights); a GGUF takes a few seconds: cache it."""
    from gpushare.catalog.model_head import read_model_info

    config, template, info = read_model_info(path)
    return describe_model(config, template, info, None)
