"""Model registry: the models a request can name, leases on loaded ones, keep_alive, live reconfiguration.

What exists comes from model_catalog (config entries and models_dir); what is loaded, and
loading within one memory budget, from residency. A request takes a lease with `use()`:
a loaded model serves at once, an unloaded one is loaded first (one load however many
ask; see residency for the budget, evictions and the warm tier), and while any lease is
held the model is never unloaded.

keep_alive as Ollama means it: seconds (negative = forever, 0 = unload when idle); each
request sets it anew (the request's value, else the model's, else the server default)
and the timer starts when the model's last request ends. A pinned model ignores it.
Every loaded model keeps its KV cache in the engine's one pool (memory.kv_budget), which it grows
and shrinks in as its requests need (engine/kv_pool.py).

Runs on the asyncio loop; the engine and the loader are only called from worker threads.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from gpushare.catalog.blob_store import drop_unused
from gpushare.catalog.model_files import without_paths
from gpushare.settings.settings import Settings
from gpushare.residency.memory_budget import HEADER_READ_TIMEOUT_S, default_budget_bytes
from gpushare.catalog.model_create import create_model, removable_file
from gpushare.catalog.model_catalog import (ModelDescription, ModelNotFound, ModelSource, RegistrationError,
                                           describe_files, describe_model, model_sources, referenced_paths)
from gpushare.protocol.device import Device
from gpushare.residency.adapter_residency import adapters_of
from gpushare.residency.entries import LoadedEntry, LoadJob, ModelLoadError, RegistryFull
from gpushare.residency.residency import Residency
from gpushare.settings.model_options import ModelPreset
from gpushare.protocol.weight_format import resolve_weights

__all__ = ["Registry", "Lease", "ModelNotFound", "RegistrationError", "ModelLoadError", "RegistryFull"]

log = logging.getLogger("gpushare.registry")


@dataclass
class Lease:
    """What a request holds while it runs: the loaded model and what its load cost this request."""
    entry: LoadedEntry
    load_duration_s: float
    tokens: int = 0  # prompt plus max_tokens of its request, once known: the copy's outstanding work

    @property
    def model(self):
        return self.entry.model

    def hold_tokens(self, tokens: int) -> None:
        """Count the request's tokens (prompt plus every answer's max_tokens) as outstanding on its copy
        until the lease ends: the registry sends requests to the copy with the fewest."""
        self.tokens += tokens
        self.entry.outstanding_tokens += tokens

    @property
    def device(self) -> Device:
        """The device the model is loaded on (protocol/device.py)."""
        return self.entry.device


class Registry:
    def __init__(self, devices: dict, settings: Settings, *, dtype: str, find_device=None,
                 memory_free_bytes: dict[str, int] | None = None):
        """`devices`: name -> device (protocol/device.py); `find_device`: a models[].device as written ->
        the name of its device; `memory_free_bytes`: a GPU device's name -> its free memory (the worker
        plan's, from NVML), for the default budget."""
        self.devices = devices
        self.dtype = dtype
        self.residency = Residency(devices, dtype=dtype, weights=settings.engine.weights, on_loaded=self._on_loaded,
                                   release=self._release, find_device=find_device)
        self._descriptions: dict[str, ModelDescription] = {}  # by ModelSource.digest()
        self._background: set[asyncio.Task] = set()
        # Measured once, at start: later the loaded models themselves would shrink "available". Devices
        # that share host RAM (CPU engines) split it; a tensor-parallel group's ranks run on those devices.
        memory_free_bytes = memory_free_bytes or {}
        kinds = {name: d.config.device for name, d in devices.items() if d.world_size == 1}
        cpu_devices = max(1, list(kinds.values()).count("cpu"))
        self._default_budget_bytes = min(
            default_budget_bytes(kind, settings.memory.host_cache_bytes, memory_free_bytes.get(name),
                                 settings.memory.device_margin_bytes)
            // (cpu_devices if kind == "cpu" else 1) for name, kind in kinds.items())
        self._apply_limits(settings)

    @property
    def device_kind(self) -> str:
        """"cuda" when any device is a GPU, else "cpu"."""
        return "cuda" if any(d.config.device != "cpu" for d in self.devices.values()) else "cpu"

    def _apply_limits(self, settings: Settings) -> None:
        self.settings = settings
        mem, res = settings.memory, self.residency
        res.budget_bytes = mem.budget_bytes if mem.budget_bytes is not None else self._default_budget_bytes
        res.max_models = mem.max_loaded_models
        res.warm.resize(mem.host_cache_bytes)
        self.max_requests_per_model = settings.engine.max_num_seqs + settings.server.max_queued

    # ------------------------------------------------------------------ what exists

    def sources(self) -> dict[str, ModelSource]:
        return model_sources(self.settings)

    def find(self, name: str) -> ModelSource:
        """The model called `name` (or `name:latest`, as Ollama resolves a bare name)."""
        sources = self.sources()
        for candidate in (name, f"{name}:latest", name.removesuffix(":latest")):
            if candidate in sources:
                return sources[candidate]
        entry = self.residency.loaded.get(name)
        if entry is not None and not entry.retired:  # its file was removed after loading; it still serves
            return entry.source
        raise ModelNotFound(f'model "{name}" not found')

    def loaded(self) -> list[LoadedEntry]:
        """Every loaded copy (a model with replicas appears once per device it is on)."""
        return self.residency.entries()

    def loading(self) -> list[LoadJob]:
        return list(self.residency.jobs.values())

    def get_loaded(self, name: str) -> LoadedEntry | None:
        return self.residency.loaded.get(name)

    def get_loading(self, name: str) -> LoadJob | None:
        return self.residency.jobs.get(name)

    def state(self, source: ModelSource) -> str:
        """"loaded", "loading", "warm" (built in host memory: a fast load) or "on disk"."""
        entry = self.residency.loaded.get(source.name)
        if entry is not None and entry.source.path == source.path:
            return "loaded"
        if source.name in self.residency.jobs:
            return "loading"
        return "warm" if self.residency.is_warm(source) else "on disk"

    @property
    def budget_bytes(self) -> int:
        return self.residency.budget_bytes

    def used_bytes(self) -> int:
        """memory.budget in use, summed over the devices."""
        return sum(self.residency.used_bytes(d) for d in self.devices)

    def cached_description(self, source: ModelSource) -> ModelDescription | None:
        """The description if known without reading files (loaded, or described before)."""
        return self._descriptions.get(source.digest())

    async def describe(self, name: str) -> ModelDescription:
        source = self.find(name)
        desc = self.cached_description(source)
        if desc is None:
            try:
                desc = await asyncio.wait_for(asyncio.to_thread(describe_files, source.path), HEADER_READ_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise ModelLoadError(f'cannot read model "{source.name}": its files took over '
                                     f"{HEADER_READ_TIMEOUT_S:g}s to read", refused=True) from None
            except Exception as e:
                log.warning("describing %s (%s) failed: %s", source.name, source.path, e)
                raise ModelLoadError(f'cannot read model "{source.name}": {without_paths(str(e), source.path)}',
                                     refused=isinstance(e, (ValueError, OSError))) from e
            self._descriptions[source.digest()] = desc
        return desc

    async def weight_format(self, name: str) -> str:
        """The weight format `name` runs in: as loaded, else what its settings resolve to on this device."""
        source = self.find(name)
        entry = self.residency.loaded.get(source.name)
        if entry is not None:
            return entry.model.weights
        desc = await self.describe(name)
        return resolve_weights(self.residency.weights_of(source), self.device_kind, set(desc.source_types))

    def kernel(self, name: str) -> str | None:
        """The kernels `name`'s linears run on while it is loaded (LoadedModel.kernel); None otherwise."""
        entry = self.residency.loaded.get(self.find(name).name)
        return entry.model.kernel if entry is not None else None

    # ------------------------------------------------------------------ create / remove

    def create(self, name: str, target: str, preset: ModelPreset | None = None,
               adapter: str | None = None) -> ModelSource:
        """Register `target` (a GGUF file, an HF folder or a model name) as `name` in models_dir, with
        `preset` on top of the target's own and `adapter` served on it (catalog/model_create.py: a symlink, or
        a .modelfile). A model of ours replaced while loaded takes its new presets at once; on other weights
        it unloads once idle."""
        create_model(self.settings.models_dir, self.sources(), self.find, name, target, preset, adapter)
        source = self.find(name)
        entry = self.residency.loaded.get(source.name)
        if entry is not None and (entry.source.path, entry.source.adapter) == (source.path, source.adapter):
            entry.source = source
        elif entry is not None:
            entry.retired = True
            if entry.active == 0:
                self.residency.start_unload(entry)
        return source

    async def remove(self, name: str) -> None:
        """Unload `name` and delete its models_dir link, .modelfile or pulled manifest (and the blobs no
        other model uses); config and Ollama-store models are refused."""
        source = self.find(name)
        path = removable_file(source)
        await self.unload(source.name)
        for device in self.devices:
            self.residency.warm.take(self.residency.warm_key(source, device))
        os.unlink(path)
        if source.origin == "pulled":
            dropped = drop_unused(self.settings.models_dir, referenced_paths(self.settings, self.sources()))
            log.info("removed %s and %d files no other model uses", source.name, len(dropped))

    # ------------------------------------------------------------------ requests

    @asynccontextmanager
    async def use(self, name: str, keep_alive_s: float | None = None):
        """Hold `name` loaded for one request; raises ModelNotFound, RegistryFull, ModelLoadError."""
        source = self.find(name)
        entry = self.pick_copy(source.name)
        if entry is not None and not entry.retired:
            if entry.active >= self.max_requests_per_model:
                raise RegistryFull(f'model "{source.name}" has {entry.active} requests in flight, the most it '
                                   f"queues (engine.max_num_seqs + server.max_queued); retry later")
            entry.active += 1
            lease = Lease(entry, 0.0)
        else:
            t0 = time.monotonic()
            entry = await (self._join_adapter(source) if source.adapter is not None
                           else self.residency.join(source, self.max_requests_per_model))  # holding our lease
            lease = Lease(entry, time.monotonic() - t0)
        entry.last_used = time.monotonic()
        self._set_keep_alive(entry, keep_alive_s)
        if source.replicas > 1:
            self.residency.grow_replicas(source)
        try:
            yield lease
        finally:
            entry.outstanding_tokens -= lease.tokens
            self._release(entry)

    async def _join_adapter(self, source: ModelSource) -> LoadedEntry:
        """Load adapter `source` onto its base, loading the base first (or using it where it is loaded)."""
        if not source.path:
            raise ModelNotFound(f'model "{source.name}" is an adapter of "{source.base}", which is not found '
                                f"(or is itself an adapter)")
        async with self.use(source.base) as base_lease:  # held until the adapter's entry holds the base
            return await self.residency.join(source, self.max_requests_per_model, base=base_lease.entry)

    def pick_copy(self, name: str) -> LoadedEntry | None:
        """The loaded copy of `name` with the fewest tokens outstanding (prompt plus max_tokens of the
        requests it holds; then the fewest requests); None when none is loaded."""
        copies = [e for e in self.residency.copies(name) if not e.retired]
        return (min(copies, key=lambda e: (e.outstanding_tokens, e.active), default=None)
                or self.residency.loaded.get(name))

    async def load(self, name: str, keep_alive_s: float | None = None) -> Lease:
        """Load without a request (Ollama's empty prompt): resets keep_alive as a request would."""
        async with self.use(name, keep_alive_s) as lease:
            return lease

    async def unload(self, name: str) -> bool:
        """Unload now if idle, else when its last request ends. False if it was not loaded."""
        source = self.find(name)
        if source.pinned:
            raise RegistrationError(f'model "{source.name}" is pinned (models[].pinned in the config): it stays '
                                    f"loaded")
        job = self.residency.jobs.get(source.name)
        if job is not None:
            await asyncio.gather(job.task, return_exceptions=True)
        copies = self.residency.copies(source.name)
        if not copies:
            return False
        for entry in copies:
            entry.keep_alive_s = 0.0
        for adapter in adapters_of(self.residency, source.name):  # each gives its lease on the base back
            await self.unload(adapter.name)
        for entry in copies:
            if entry.active == 0 and self.residency.holds(entry):
                await asyncio.shield(self.residency.start_unload(entry))
        return True

    async def preload(self) -> None:
        """Load every model the config marks preload or pinned (a failure raises: at start it stops the daemon)."""
        for m in self.settings.models:
            if (m.preload or m.pinned) and m.name not in self.residency.loaded:
                await self.load(m.name)

    async def close(self) -> None:
        await self.residency.close()

    def apply_settings(self, settings: Settings) -> None:
        """Take a new config live (call on the event loop): the model list, keep_alive defaults, budgets.

        Requests in flight run on. A loaded model whose entry is gone (or now names another
        file) takes no new request and unloads once idle; pinned and keep_alive changes apply
        to loaded models at once, and so does weight; a smaller budget or
        max_loaded_models unloads idle models, least recently used first; new preload or
        pinned models load in the background.
        """
        self._apply_limits(settings)
        sources = self.sources()
        for entry in self.residency.entries():
            new = sources.get(entry.name)
            if new is None or (new.path, new.adapter) != (entry.source.path, entry.source.adapter):
                entry.retired = True
                if entry.active == 0:
                    self.residency.start_unload(entry)
                continue
            pinned_changed = new.pinned != entry.source.pinned
            if new.weight != entry.source.weight:
                entry.device.set_share_weight(entry.name, new.weight)
            entry.source = new
            if pinned_changed:  # keep_alive starts afresh from the model's or the server's default
                self._set_keep_alive(entry, None)
                if entry.active == 0:
                    self._arm_timer(entry)
        self.residency.evict_over_limits()
        self.residency.notify_room()
        task = asyncio.get_running_loop().create_task(self._preload_logged())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def forget_device(self, device: str) -> None:
        """`device`'s worker died (its requests already failed): forget the models it held."""
        gone = self.residency.forget_device(device)
        if gone:
            log.warning("device %s lost its models: %s; they load again on demand", device,
                        ", ".join(e.name for e in gone))

    def device_back(self, device: str) -> None:
        """`device`'s worker runs again: load the preload and pinned models that are not loaded."""
        self.residency.notify_room()
        task = asyncio.get_running_loop().create_task(self._preload_logged())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _preload_logged(self) -> None:
        try:
            await self.preload()
        except Exception as e:
            log.error("preloading after a config reload failed: %s", e)

    # ------------------------------------------------------------------ keep_alive

    def _on_loaded(self, entry: LoadedEntry) -> None:
        info = {**entry.model.metadata, "kind": entry.model.kind}
        self._descriptions[entry.warm_key[0]] = describe_model(entry.model.config, entry.model.template_source,
                                                               info, entry.parameter_count)
        entry.keep_alive_s = self.settings.server.keep_alive_s
        if entry.active == 0:  # every request that waited for it has left
            self._set_keep_alive(entry, None)
            self._arm_timer(entry)

    def _set_keep_alive(self, entry: LoadedEntry, keep_alive_s: float | None) -> None:
        for value in (keep_alive_s, entry.source.keep_alive_s, self.settings.server.keep_alive_s):
            if value is not None:
                entry.keep_alive_s = value
                break
        self._cancel_timer(entry)
        forever = entry.keep_alive_s < 0 or entry.source.pinned
        entry.expires_at = None if forever else time.time() + entry.keep_alive_s

    def _cancel_timer(self, entry: LoadedEntry) -> None:
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None

    def _arm_timer(self, entry: LoadedEntry) -> None:
        self._cancel_timer(entry)
        if entry.keep_alive_s < 0 or entry.source.pinned:
            entry.expires_at = None
            return
        entry.expires_at = time.time() + entry.keep_alive_s
        entry.timer = asyncio.get_running_loop().call_later(entry.keep_alive_s, self._expire, entry)

    def _expire(self, entry: LoadedEntry) -> None:
        entry.timer = None
        if entry.active == 0 and self.residency.holds(entry):
            self.residency.start_unload(entry)

    def _release(self, entry: LoadedEntry) -> None:
        """A lease ends; the last one starts the keep_alive timer (or the unload of a retired model)."""
        entry.active -= 1
        entry.last_used = time.monotonic()
        if entry.active == 0 and self.residency.holds(entry):
            if entry.retired:
                self.residency.start_unload(entry)
            else:
                self._arm_timer(entry)
            self.residency.notify_room()  # an idle model may now be evicted for a waiting load
