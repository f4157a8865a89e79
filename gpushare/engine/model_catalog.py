"""What models exist and what they are: config entries, the models_dir scan, descriptions.

Models come from the config's `models` list and from a scan of `models_dir` (every
``*.gguf`` file and every folder holding a config.json; the config wins a name clash).
A description (what /api/show and /api/tags tell) is read from the files without the
weights, or from the loaded model.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from gpushare.config import Settings


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
    origin: str = "config"  # "config" | "models_dir"
    pinned: bool = False  # never evicted nor unloaded
    preload: bool = False  # loaded at daemon start
    weight: float = 1.0  # share of engine steps when several models are busy
    weights: str | None = None  # weight format (models[].weights); None: engine.weights

    @property
    def format(self) -> str:
        return "safetensors" if os.path.isdir(self.path) else "gguf"

    def size_bytes(self) -> int:
        if os.path.isdir(self.path):
            return sum(p.stat().st_size for p in Path(self.path).glob("*.safetensors"))
        return os.path.getsize(self.path)

    def modified_at(self) -> float:
        return os.path.getmtime(self.path)

    def digest(self) -> str:
        """A stable ID from path, size and mtime (hashing multi-GB weights on every list is too slow)."""
        key = f"{os.path.realpath(self.path)}:{self.size_bytes()}:{self.modified_at()}"
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
    return found


def model_sources(settings: Settings) -> dict[str, ModelSource]:
    """Every available model by name: the models_dir scan, overridden by the config's entries."""
    found = {s.name: s for s in scan_models_dir(settings.models_dir)}
    for m in settings.models:
        found[m.name] = ModelSource(m.name, m.path, m.keep_alive_s, origin="config", pinned=m.pinned,
                                    preload=m.preload, weight=m.weight, weights=m.weights)
    return found


@dataclass
class ModelDescription:
    """What /api/show and /api/tags tell about a model, read from its files or its loaded form."""
    details: dict  # Ollama's details: format, family, families, parameter_size, quantization_level
    model_info: dict  # GGUF-style keys: general.architecture, <arch>.context_length, ...
    template: str | None
    context_length: int
    source_types: frozenset = frozenset()  # GGUF type names of the matrices (weight_format.resolve_weights)


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
    details = {"parent_model": "", "format": info.get("format", ""), "family": arch, "families": [arch],
               "parameter_size": size_label, "quantization_level": info.get("quantization_level") or ""}
    return ModelDescription(details, model_info, template, config.context_length,
                            frozenset(info.get("source_types", ())))


def _size_label(count: int) -> str:
    return f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.0f}M"


def describe_files(path: str) -> ModelDescription:
    """Read only what describes the model (no weights); a GGUF takes a few seconds: cache it."""
    from gpushare.models.loader import read_model_info

    config, template, info = read_model_info(path)
    return describe_model(config, template, info, None)
