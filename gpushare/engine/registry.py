"""Model registry: which models exist, which are loaded, loading on demand and keep_alive.

Models come from the config's `models` list and from a scan of `models_dir` (every
``*.gguf`` file and every folder holding a config.json; the config wins a name clash).
A request takes a lease with `use()`: the model is loaded if needed (in a worker thread;
concurrent requests for one model share one load), its in-flight count keeps it resident,
and when the last request ends the keep_alive timer starts. keep_alive as Ollama means
it: seconds (negative = forever, 0 = unload when idle); each request sets it anew (the
request's value, else the model's, else the server default).

Each loaded model gets a KV pool of kv_budget / max_loaded_models bytes. When a load
would pass max_loaded_models or memory.budget, idle models are unloaded least recently
used first; busy ones never are. memory.budget counts the loaded models' weights and KV
pools; a model not yet loaded is estimated by its file size (a quantised GGUF grows
when dequantised, so the estimate is low until it has loaded).

Runs on the asyncio loop; the engine and the loader are only called from worker threads.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from gpushare.config import Settings

log = logging.getLogger("gpushare.registry")


class ModelNotFound(KeyError):
    def __str__(self) -> str:
        return self.args[0]


class RegistryFull(RuntimeError):
    """No room: too many requests queued for a model, or no idle model left to evict."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelLoadError(RuntimeError):
    pass


class RegistrationError(ValueError):
    """`create` or `remove` refused: a bad name or path, or a model the config defines."""


@dataclass
class ModelSource:
    name: str
    path: str
    keep_alive_s: float | None = None  # None: the server default
    origin: str = "config"  # "config" | "models_dir"

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


@dataclass
class LoadedEntry:
    source: ModelSource
    model: object  # gpushare.models.loader.LoadedModel
    kv_cache_bytes: int
    load_duration_s: float
    keep_alive_s: float
    active: int = 0
    last_used: float = field(default_factory=time.monotonic)
    expires_at: float | None = None  # wall-clock epoch seconds; None: never (or busy, keep_alive < 0)
    timer: asyncio.TimerHandle | None = None

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def size_bytes(self) -> int:
        return self.model.weight_bytes + self.kv_cache_bytes


@dataclass
class ModelDescription:
    """What /api/show and /api/tags tell about a model, read from its files or its loaded form."""
    details: dict  # Ollama's details: format, family, families, parameter_size, quantization_level
    model_info: dict  # GGUF-style keys: general.architecture, <arch>.context_length, ...
    template: str | None
    context_length: int


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
    return ModelDescription(details, model_info, template, config.context_length)


def _size_label(count: int) -> str:
    return f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.0f}M"


def describe_loaded(model) -> ModelDescription:
    count = sum(p.numel() for p in model.model.parameters())
    return describe_model(model.config, model.template_source, model.metadata, count)


def describe_files(path: str) -> ModelDescription:
    """Read only what describes the model (no weights); a GGUF takes a few seconds: cache it."""
    from gpushare.models.loader import read_model_info

    config, template, info = read_model_info(path)
    return describe_model(config, template, info, None)


@dataclass
class Lease:
    """What a request holds while it runs: the loaded model and what its load cost this request."""
    entry: LoadedEntry
    load_duration_s: float

    @property
    def model(self):
        return self.entry.model


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


def _default_loader(path: str, dtype: str, device: str):
    from gpushare.models.loader import load_model

    return load_model(path, dtype=dtype, device=device)


class Registry:
    def __init__(self, engine, settings: Settings, *, device: str, dtype: str, loader=_default_loader):
        self.engine = engine
        self.settings = settings
        self.device = device
        self.dtype = dtype
        self._loader = loader
        self._loaded: dict[str, LoadedEntry] = {}
        self._loading: dict[str, asyncio.Task] = {}
        self._unloading: dict[str, asyncio.Task] = {}
        self._descriptions: dict[str, ModelDescription] = {}  # by ModelSource.digest()
        self.max_requests_per_model = settings.engine.max_num_seqs + settings.server.max_queued

    # ------------------------------------------------------------------ what exists

    def sources(self) -> dict[str, ModelSource]:
        found = {s.name: s for s in scan_models_dir(self.settings.models_dir)}
        for m in self.settings.models:
            found[m.name] = ModelSource(m.name, m.path, m.keep_alive_s, origin="config")
        return found

    def find(self, name: str) -> ModelSource:
        """The model called `name` (or `name:latest`, as Ollama resolves a bare name)."""
        sources = self.sources()
        for candidate in (name, f"{name}:latest", name.removesuffix(":latest")):
            if candidate in sources:
                return sources[candidate]
        if name in self._loaded:  # its file was removed after loading; it still serves
            return self._loaded[name].source
        raise ModelNotFound(f'model "{name}" not found')

    def loaded(self) -> list[LoadedEntry]:
        return list(self._loaded.values())

    def get_loaded(self, name: str) -> LoadedEntry | None:
        return self._loaded.get(name)

    def cached_description(self, source: ModelSource) -> ModelDescription | None:
        """The description if known without reading files (loaded, or described before)."""
        return self._descriptions.get(source.digest())

    async def describe(self, name: str) -> ModelDescription:
        source = self.find(name)
        desc = self.cached_description(source)
        if desc is None:
            try:
                desc = await asyncio.to_thread(describe_files, source.path)
            except Exception as e:
                raise ModelLoadError(f'cannot read model "{source.name}" ({source.path}): {e}') from e
            self._descriptions[source.digest()] = desc
        return desc

    # ------------------------------------------------------------------ create / remove

    def create(self, name: str, target: str) -> ModelSource:
        """Register `target` (a .gguf file, an HF folder or a model name) as `name` in models_dir (a symlink)."""
        if not name or "/" in name or name.startswith(".") or name != name.strip():
            raise RegistrationError(f"invalid model name {name!r}: no '/', no leading '.', no surrounding spaces")
        if name in self.sources():
            raise RegistrationError(f'a model named "{name}" already exists')
        path = Path(self.find(target).path if target in self.sources() else target).expanduser()
        if not path.is_absolute():
            raise RegistrationError(f"path {str(path)!r} must be absolute (it is resolved by the daemon)")
        if path.is_file() and path.suffix == ".gguf":
            link = self.settings.models_dir / f"{name}.gguf"
        elif path.is_dir() and (path / "config.json").is_file():
            link = self.settings.models_dir / name
        else:
            raise RegistrationError(f"{str(path)!r} is neither a .gguf file nor a Hugging Face folder with "
                                    f"config.json, nor a model name")
        self.settings.models_dir.mkdir(parents=True, exist_ok=True)
        link.symlink_to(path.resolve())
        return self.find(name)

    async def remove(self, name: str) -> None:
        """Unload `name` and delete its models_dir link; real files and config models are refused."""
        source = self.find(name)
        if source.origin == "config":
            raise RegistrationError(f'model "{source.name}" is defined in the config file; remove it there')
        if not os.path.islink(source.path):
            raise RegistrationError(f'model "{source.name}" is a file in the models directory, not a link made by '
                                    f"create; delete it yourself: {source.path}")
        await self.unload(source.name)
        os.unlink(source.path)

    # ------------------------------------------------------------------ requests

    @asynccontextmanager
    async def use(self, name: str, keep_alive_s: float | None = None):
        """Hold `name` loaded for one request; raises ModelNotFound, RegistryFull, ModelLoadError."""
        source = self.find(name)
        entry = self._loaded.get(source.name)
        if entry is not None:
            if entry.active >= self.max_requests_per_model:
                raise RegistryFull(f'model "{source.name}" has {entry.active} requests in flight, the most it '
                                   f"queues (engine.max_num_seqs + server.max_queued); retry later")
            lease = Lease(entry, 0.0)
        else:  # load it, or wait for the load another request started
            t0 = time.monotonic()
            entry = await self._ensure_loaded(source)
            lease = Lease(entry, time.monotonic() - t0)
        entry.active += 1
        self._set_keep_alive(entry, keep_alive_s)
        try:
            yield lease
        finally:
            entry.active -= 1
            entry.last_used = time.monotonic()
            if entry.active == 0:
                self._arm_timer(entry)

    async def load(self, name: str, keep_alive_s: float | None = None) -> Lease:
        """Load without a request (Ollama's empty prompt): resets keep_alive as a request would."""
        async with self.use(name, keep_alive_s) as lease:
            return lease

    async def unload(self, name: str) -> bool:
        """Unload now if idle, else when its last request ends. False if it was not loaded."""
        source = self.find(name)
        if source.name in self._loading:
            await asyncio.shield(self._loading[source.name])
        entry = self._loaded.get(source.name)
        if entry is None:
            return False
        entry.keep_alive_s = 0.0
        if entry.active == 0:
            await self._unload(entry)
        return True

    async def close(self) -> None:
        for task in list(self._loading.values()):
            await asyncio.gather(task, return_exceptions=True)
        for entry in list(self._loaded.values()):
            await self._unload(entry)

    # ------------------------------------------------------------------ keep_alive

    def _set_keep_alive(self, entry: LoadedEntry, keep_alive_s: float | None) -> None:
        for value in (keep_alive_s, entry.source.keep_alive_s, self.settings.server.keep_alive_s):
            if value is not None:
                entry.keep_alive_s = value
                break
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        entry.expires_at = None if entry.keep_alive_s < 0 else time.time() + entry.keep_alive_s

    def _arm_timer(self, entry: LoadedEntry) -> None:
        if entry.keep_alive_s < 0:
            entry.expires_at = None
            return
        entry.expires_at = time.time() + entry.keep_alive_s
        loop = asyncio.get_running_loop()
        entry.timer = loop.call_later(entry.keep_alive_s, self._expire, entry)

    def _expire(self, entry: LoadedEntry) -> None:
        entry.timer = None
        if entry.active == 0 and self._loaded.get(entry.name) is entry:
            self._start_unload(entry)

    # ------------------------------------------------------------------ load / unload

    async def _ensure_loaded(self, source: ModelSource) -> LoadedEntry:
        while source.name in self._unloading:
            await asyncio.shield(self._unloading[source.name])
        if source.name in self._loaded:
            return self._loaded[source.name]
        task = self._loading.get(source.name)
        if task is None:
            evictions = self._make_room(source)  # synchronous: no other load can interleave
            task = asyncio.get_running_loop().create_task(self._load(source, evictions))
            self._loading[source.name] = task
        # shield: a client that leaves does not cancel a load others may be waiting on
        return await asyncio.shield(task)

    def kv_cache_bytes_per_model(self) -> int:
        return self.settings.memory.kv_budget_bytes // self.settings.memory.max_loaded_models

    def _make_room(self, source: ModelSource) -> list[asyncio.Task]:
        """Start unloading idle models (least recently used first) so that `source` fits."""
        mem = self.settings.memory
        idle = sorted((e for e in self._loaded.values() if e.active == 0), key=lambda e: e.last_used)
        count = len(self._loaded) + len(self._loading)
        used = sum(e.size_bytes for e in self._loaded.values())
        need = source.size_bytes() + self.kv_cache_bytes_per_model()
        victims = []
        while count >= mem.max_loaded_models or (mem.budget_bytes is not None and used + need > mem.budget_bytes):
            if not idle:
                why = (f"{count} models loaded or loading (memory.max_loaded_models = {mem.max_loaded_models})"
                       if count >= mem.max_loaded_models else
                       f"{used + need} bytes needed, memory.budget is {mem.budget_bytes}")
                raise RegistryFull(f'cannot load model "{source.name}": {why} and none is idle; retry later', 5)
            victim = idle.pop(0)
            victims.append(victim)
            count -= 1
            used -= victim.size_bytes
        return [self._start_unload(v) for v in victims]

    async def _load(self, source: ModelSource, evictions: list[asyncio.Task]) -> LoadedEntry:
        try:
            await asyncio.gather(*evictions)
            t0 = time.monotonic()
            kv_bytes = self.kv_cache_bytes_per_model()
            log.info("loading model %s from %s", source.name, source.path)
            try:
                model = await asyncio.to_thread(self._load_blocking, source, kv_bytes)
            except Exception as e:
                log.warning("loading %s failed: %s", source.name, e)
                raise ModelLoadError(f'failed to load model "{source.name}": {e}') from e
            load_s = time.monotonic() - t0
            log.info("loaded model %s in %.1fs", source.name, load_s)
            entry = LoadedEntry(source, model, kv_bytes, load_s, self.settings.server.keep_alive_s)
            self._descriptions[source.digest()] = describe_loaded(model)
            self._loaded[source.name] = entry
            return entry
        finally:
            del self._loading[source.name]

    def _load_blocking(self, source: ModelSource, kv_bytes: int):
        model = self._loader(source.path, self.dtype, self.device)
        self.engine.add_model(source.name, model, kv_cache_bytes=kv_bytes)
        return model

    async def _unload(self, entry: LoadedEntry) -> None:
        if self._loaded.get(entry.name) is entry:
            await asyncio.shield(self._start_unload(entry))

    def _start_unload(self, entry: LoadedEntry) -> asyncio.Task:
        """Forget `entry` at once and remove it from the engine in a worker thread."""
        log.info("unloading model %s", entry.name)
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        del self._loaded[entry.name]
        task = asyncio.get_running_loop().create_task(asyncio.to_thread(self.engine.remove_model, entry.name))
        self._unloading[entry.name] = task
        task.add_done_callback(lambda t: self._unload_done(entry.name, t))
        return task

    def _unload_done(self, name: str, task: asyncio.Task) -> None:
        if self._unloading.get(name) is task:
            del self._unloading[name]
        if not task.cancelled() and task.exception() is not None:
            log.error("removing model %s from the engine failed: %s", name, task.exception())
