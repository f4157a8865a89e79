"""`create`, `cp` and `rm` of models in models_dir: what gets written, and what may be removed.

A model with no presets is a symlink to its weights (`NAME.gguf` -> a GGUF file, whatever
its own name: it is recognised by its magic bytes, so Ollama's `sha256-<hex>` blobs do;
`NAME` -> a Hugging Face folder). A model with presets (a Modelfile's PARAMETER, SYSTEM,
TEMPLATE, MESSAGE, LICENSE, or a copy of a model that has them) is a `NAME.modelfile`
whose FROM is the weights' absolute path. FROM an existing model name takes that
model's weights and presets, the new ones on top. Nothing is ever written outside
models_dir, so Ollama's store and the config's files stay as they are. A model with an ADAPTER
(a LoRA adapter: a PEFT folder or a GGUF LoRA, by absolute path) is always a `.modelfile` whose
FROM is the base model's name (or its weights' path) and ADAPTER the adapter's path: the base
stays a model of its own, loaded once for all its adapters. As `ollama create`
does, creating a name that exists replaces it, when it is one of ours (a link or a
.modelfile in models_dir); a config or Ollama-store model of that name is refused.
"""

from __future__ import annotations

import os
from pathlib import Path

from gpushare.catalog.model_catalog import MODELFILE_SUFFIX, ModelSource, RegistrationError
from gpushare.catalog.model_files import ModelFileError, checked_path, open_regular
from gpushare.catalog.modelfile import ModelfileError, format_modelfile
from gpushare.settings.model_options import ModelPreset

GGUF_MAGIC = b"GGUF"


def is_gguf(path: Path) -> bool:
    try:
        with open_regular(str(path)) as f:  # a FIFO is refused, never waited on
            return f.read(4) == GGUF_MAGIC
    except (OSError, ModelFileError):
        return False


def replaced_file(name: str, sources: dict[str, ModelSource]) -> str | None:
    """The file of the model `name` that a create replaces (None: a new name); refuses bad or foreign names."""
    if (not name or "/" in name or name.startswith(".") or name != name.strip() or name.endswith(MODELFILE_SUFFIX)
            or not name.isprintable()):
        raise RegistrationError(f"invalid model name {name!r}: no '/', no leading '.', no surrounding spaces, "
                                "no control characters")
    existing = sources.get(name) or sources.get(f"{name}:latest")
    if existing is None:
        return None
    try:
        return removable_file(existing)
    except RegistrationError as e:
        raise RegistrationError(f'a model named "{existing.name}" already exists and cannot be replaced: {e}') from None


def resolve_base(base: str, sources: dict[str, ModelSource], find) -> tuple[Path, ModelPreset]:
    """The weights FROM names (a model's name, a GGUF file, an HF folder) and the presets it brings."""
    if base in sources or f"{base}:latest" in sources:
        source = find(base)
        return Path(source.path), source.preset
    path = Path(base).expanduser()
    if not path.is_absolute():
        raise RegistrationError(f"path {str(path)!r} must be absolute (it is resolved by the daemon)")
    if path.is_file() and is_gguf(path):
        return path, ModelPreset()
    if path.is_dir() and (path / "config.json").is_file():
        return path, ModelPreset()
    raise RegistrationError(f"{str(path)!r} is neither a GGUF file nor a Hugging Face folder with config.json, "
                            f"nor a model name")


def adapter_path(adapter: str) -> Path:
    """An ADAPTER's path, checked: absolute, a PEFT folder (adapter_config.json) or a GGUF file."""
    path = Path(adapter).expanduser()
    if not path.is_absolute():
        raise RegistrationError(f"adapter path {str(path)!r} must be absolute (it is resolved by the daemon)")
    try:  # a link out of the folder is refused here as at every load (catalog/model_files.py)
        config = path.is_dir() and checked_path(str(path), "adapter_config.json")
    except ModelFileError as e:
        raise RegistrationError(f"adapter {str(path)!r}: {e}") from None
    if not ((config and os.path.isfile(config)) or (path.is_file() and is_gguf(path))):
        raise RegistrationError(f"adapter {str(path)!r} is neither a PEFT folder with adapter_config.json nor a "
                                f"GGUF LoRA file")
    return path.resolve()


def adapter_base(base: str, sources: dict[str, ModelSource], find) -> str:
    """What an adapter's FROM keeps: the base model's name, or its weights' absolute path."""
    if base in sources or f"{base}:latest" in sources:
        source = find(base)
        if source.adapter is not None:
            raise RegistrationError(f'model "{source.name}" is itself an adapter; an adapter is made FROM a model')
        return source.name
    return str(resolve_base(base, sources, find)[0].resolve())


def create_model(models_dir: Path, sources: dict[str, ModelSource], find, name: str, base: str,
                 preset: ModelPreset | None = None, adapter: str | None = None) -> None:
    """Write NAME into models_dir: a link, or a .modelfile when it has presets or an adapter (replacing our own
    NAME)."""
    old = replaced_file(name, sources)
    named = sources.get(base) or sources.get(f"{base}:latest")
    inherited = ModelPreset()  # an adapter's base's presets come with it when the catalog links the two
    if adapter is None and named is not None and named.adapter is not None:  # a copy of an adapter model
        base, adapter, inherited = named.base, named.adapter, named.preset
    if adapter is not None:
        weights, adapter = adapter_base(base, sources, find), str(adapter_path(adapter))
    else:
        weights, inherited = resolve_base(base, sources, find)
        weights = str(weights.resolve())
    preset = (preset or ModelPreset()).over(inherited)
    models_dir.mkdir(parents=True, exist_ok=True)
    if not preset.is_empty() or adapter is not None:
        target = models_dir / f"{name}{MODELFILE_SUFFIX}"
        tmp = target.with_name(f".{target.name}.tmp")
        try:
            text = format_modelfile(weights, preset, adapter=adapter)
        except ModelfileError as e:
            raise RegistrationError(str(e)) from None
        tmp.write_text(text)
    else:
        target = models_dir / (name if os.path.isdir(weights) else f"{name}.gguf")
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(weights)
    os.replace(tmp, target)  # whole or not at all: a scan never reads half a file, nor no model at all
    if old is not None and os.path.abspath(old) != os.path.abspath(target):
        os.unlink(old)  # the old form (a link where now a .modelfile, or the other way)


def removable_file(source: ModelSource) -> str:
    """The file `rm` deletes for `source` (its link or .modelfile); RegistrationError when it is not ours."""
    if source.origin == "config":
        raise RegistrationError(f'model "{source.name}" is defined in the config file; remove it there')
    if source.origin == "ollama":
        raise RegistrationError(f'model "{source.name}" is in Ollama\'s store ({source.definition}), which gpushare '
                                f"only reads; remove it with `ollama rm {source.name}`")
    if source.definition is not None:  # a .modelfile, or a pulled model's manifest
        return source.definition
    if not os.path.islink(source.path):
        raise RegistrationError(f'model "{source.name}" is a file in the models directory, not a link made by '
                                f"create; delete it yourself: {source.path}")
    return source.path
