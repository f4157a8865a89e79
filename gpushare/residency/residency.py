"""The models resident in the engine and the memory they hold: load jobs, evictions, unloads.

One load job per model: concurrent requests for it wait on the same job, and the moment it
has loaded each of them holds a lease (so nothing can evict it between the load and their
first step). A job sizes the model from its file (memory_budget; the real size replaces
the estimate after the first load), waits for room in memory.budget (the engine's KV pool,
memory.kv_budget, counts once; then the weights of every loaded model; and max_loaded_models), unloading idle models least recently used
first, never a pinned one nor one with running or queued requests; then it loads the
model in a worker thread, from the warm tier when it is there, else from its file with
progress. With no idle model to unload it waits up to `room_wait_timeout_s` (RegistryFull,
503 with Retry-After); a model that can never fit or a load that fails raises
ModelLoadError and frees what it took. Unloaded models go to the warm tier.

Everything here runs on the asyncio loop; the engine and the loader only in worker threads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from gpushare.residency.memory_budget import Resident, count_tensors, estimate_weight_bytes, plan_evictions
from gpushare.residency.model_catalog import ModelSource
from gpushare.residency.warm_cache import WarmCache, to_device, to_host
from gpushare.models.weight_format import resolve_weights

log = logging.getLogger("gpushare.registry")

ROOM_WAIT_TIMEOUT_S = 300.0  # as Ollama's OLLAMA_LOAD_TIMEOUT: how long a load waits for busy models


class RegistryFull(RuntimeError):
    """No room now: too many requests queued for a model, or memory held by busy models too long."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelLoadError(RuntimeError):
    pass


@dataclass
class LoadedEntry:
    source: ModelSource
    model: object  # gpushare.models.loader.LoadedModel
    weight_bytes: int
    load_duration_s: float
    warm_load: bool  # taken from the warm tier rather than parsed from its file
    warm_key: tuple  # (file digest, dtype, weights, device): its place in the warm tier once unloaded
    parameter_count: int
    keep_alive_s: float = 0.0
    active: int = 0  # leases held: requests running, queued in the engine, or about to submit
    last_used: float = field(default_factory=time.monotonic)
    expires_at: float | None = None  # wall-clock epoch seconds; None: never (or busy, keep_alive < 0)
    timer: asyncio.TimerHandle | None = None
    retired: bool = False  # its config entry is gone: takes no new request, unloads once idle
    engine: object = None  # the engine of the device it is loaded on

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def size_bytes(self) -> int:
        """What it holds of memory.budget: its weights (its KV lives in the engine's shared pool)."""
        return self.weight_bytes


@dataclass
class LoadJob:
    """One model on its way in; every request for it waits on `task`."""
    source: ModelSource
    state: str = "queued"  # "queued" (sizing it, waiting for memory) | "loading"
    reserved_bytes: int = 0  # weights, counted against memory.budget once room is found
    done_bytes: int = 0
    total_bytes: int = 0
    waiters: int = 0  # requests waiting; they hold a lease the moment it loads
    task: asyncio.Task | None = None

    @property
    def progress(self) -> float:
        """Fraction of the file read and dequantised (0 until the loader reports)."""
        return self.done_bytes / self.total_bytes if self.total_bytes else 0.0

    def report(self, done_bytes: int, total_bytes: int) -> None:  # loader thread
        self.done_bytes, self.total_bytes = done_bytes, total_bytes


class Residency:
    def __init__(self, engine, *, device: str, dtype: str, weights: str, loader, on_loaded, release):
        self.engine = engine
        self.device = device
        self.dtype = dtype
        self.weights = weights  # engine.weights: the format of models whose entry names none
        self._loader = loader  # (path, dtype, device, progress, weights=...) -> LoadedModel
        self._on_loaded = on_loaded  # (LoadedEntry) -> None, when a job has put a model in
        self._release = release  # (LoadedEntry) -> None, to give a lease back
        self.loaded: dict[str, LoadedEntry] = {}
        self.jobs: dict[str, LoadJob] = {}
        self.unloading: dict[str, asyncio.Task] = {}
        self.warm = WarmCache(0)
        self.budget_bytes = 0
        self.max_models = 1
        self.room_wait_timeout_s = ROOM_WAIT_TIMEOUT_S
        self.closing = False
        self._sizes: dict[tuple, tuple[int, int]] = {}  # warm key -> (weight bytes, parameter count)
        self._room_changed = asyncio.Event()

    def weights_of(self, source: ModelSource) -> str:
        """The weight format setting for `source` (models[].weights, else engine.weights; may be auto)."""
        return source.weights or self.weights

    def warm_key(self, source: ModelSource) -> tuple:
        return (source.digest(), self.dtype, self.weights_of(source), self.device)

    def used_bytes(self) -> int:
        """memory.budget in use: the engine's KV pool, loaded models and the loads that found room."""
        return (self.engine.kv_pool.capacity_bytes + sum(e.size_bytes for e in self.loaded.values())
                + sum(j.reserved_bytes for j in self.jobs.values()))

    def residents(self) -> list[Resident]:
        return [Resident(e.name, e.size_bytes, e.last_used,
                         e.active == 0 and not e.source.pinned and not self.engine.has_work(e.name))
                for e in self.loaded.values()]

    def notify_room(self) -> None:
        """Wake the loads waiting for memory (and requests waiting for an old model to leave)."""
        self._room_changed.set()
        self._room_changed = asyncio.Event()

    async def room_changed(self) -> None:
        await self._room_changed.wait()

    def evict_over_limits(self) -> None:
        """After the limits shrank: unload idle models, least recently used first, until they hold."""
        victims = plan_evictions(self.residents(), 0, self.used_bytes(), self.budget_bytes, self.max_models + 1,
                                 len(self.loaded))
        for victim in victims or []:
            self.start_unload(self.loaded[victim.name])

    # ------------------------------------------------------------------ load

    async def join(self, source: ModelSource, max_waiters: int) -> LoadedEntry:
        """Wait for `source` to load (starting its job if none runs); returns holding a lease on it."""
        while True:
            entry = self.loaded.get(source.name)
            if entry is not None and not entry.retired:
                entry.active += 1
                return entry
            if entry is not None or source.name in self.unloading:  # the old one must leave first
                await self.room_changed()
                continue
            job = self.jobs.get(source.name)
            if job is None:
                job = self.jobs[source.name] = LoadJob(source)
                job.task = asyncio.get_running_loop().create_task(self._run(job))
            if job.waiters >= max_waiters:
                raise RegistryFull(f'model "{source.name}" has {job.waiters} requests waiting for it to load, the '
                                   f"most it queues (engine.max_num_seqs + server.max_queued); retry later")
            job.waiters += 1
            try:
                # shield: a client that leaves does not cancel a load others may be waiting on
                return await asyncio.shield(job.task)
            except asyncio.CancelledError:
                if job.task.done() and not job.task.cancelled() and job.task.exception() is None:
                    self._release(job.task.result())  # loaded just as we left: give our lease back
                else:
                    job.waiters -= 1
                raise

    async def _run(self, job: LoadJob) -> LoadedEntry:
        source = job.source
        try:
            key = self.warm_key(source)
            if key not in self._sizes:
                try:
                    count = await asyncio.to_thread(count_tensors, source.path)
                except (OSError, ValueError) as e:
                    raise ModelLoadError(f'failed to load model "{source.name}": {e}') from e
                weights = resolve_weights(self.weights_of(source), self.device, set(count.source_types))
                self._sizes[key] = (estimate_weight_bytes(count, weights), count.parameters)
            estimate_bytes, parameter_count = self._sizes[key]
            evictions = await self._wait_for_room(job, estimate_bytes)
            job.state = "loading"
            await asyncio.gather(*evictions, *self.unloading.values())
            entry = await self._load(job, key, estimate_bytes, parameter_count)
            entry.active = job.waiters  # each waiting request holds a lease from this moment
            self.loaded[source.name] = entry
            self._on_loaded(entry)
            return entry
        finally:
            del self.jobs[source.name]
            self.notify_room()

    async def _wait_for_room(self, job: LoadJob, need_bytes: int) -> list[asyncio.Task]:
        """Reserve `need_bytes` of the budget, starting the unloads that make room; waits while busy
        models hold it. ModelLoadError when it could never fit, RegistryFull after the wait timeout."""
        source = job.source
        deadline = time.monotonic() + self.room_wait_timeout_s
        while True:
            if self.closing:
                raise RegistryFull(f'cannot load model "{source.name}": the daemon is stopping', 5)
            pinned_bytes = sum(e.size_bytes for e in self.loaded.values() if e.source.pinned)
            kv_pool_bytes = self.engine.kv_pool.capacity_bytes
            if need_bytes + pinned_bytes + kv_pool_bytes > self.budget_bytes:
                raise ModelLoadError(
                    f'failed to load model "{source.name}": not enough memory: it needs {need_bytes} bytes '
                    f"of weights, memory.budget is {self.budget_bytes} bytes, the KV pool (memory.kv_budget) "
                    f"takes {kv_pool_bytes} and pinned models hold {pinned_bytes}")
            reserving = sum(1 for j in self.jobs.values() if j.reserved_bytes)
            victims = plan_evictions(self.residents(), need_bytes, self.used_bytes(), self.budget_bytes,
                                     self.max_models, len(self.loaded) + reserving)
            if victims is not None:
                job.reserved_bytes = need_bytes
                return [self.start_unload(self.loaded[v.name]) for v in victims]
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                busy = ", ".join(e.name for e in self.loaded.values() if e.active) or "none"
                raise RegistryFull(f'cannot load model "{source.name}": it needs {need_bytes} bytes, '
                                   f"{self.budget_bytes - self.used_bytes()} are free in memory.budget "
                                   f"({self.budget_bytes} bytes, max_loaded_models {self.max_models}) and the "
                                   f"models holding the rest stayed busy ({busy}); retry later", 5)
            try:
                await asyncio.wait_for(self.room_changed(), remaining_s)
            except asyncio.TimeoutError:
                pass

    async def _load(self, job: LoadJob, key: tuple, estimate_bytes: int, parameter_count: int) -> LoadedEntry:
        source = job.source
        warm = self.warm.take(key)
        log.info("loading model %s from %s (estimated %d bytes of weights)", source.name,
                 "the warm tier" if warm else source.path, estimate_bytes)
        t0 = time.monotonic()
        try:
            model = await asyncio.to_thread(self._load_blocking, source, warm, job)
        except Exception as e:
            log.warning("loading %s failed: %s", source.name, e)
            raise ModelLoadError(f'failed to load model "{source.name}": {e}') from e
        load_s = time.monotonic() - t0
        weight_bytes = model.weight_bytes
        self._sizes[key] = (weight_bytes, parameter_count)
        job.reserved_bytes = weight_bytes
        if weight_bytes > estimate_bytes:  # the estimate was low: unload more idle models, or give it all back
            victims = plan_evictions(self.residents(), 0, self.used_bytes(), self.budget_bytes, 1, 0)
            if victims is None:
                await asyncio.to_thread(self.engine.remove_model, source.name)
                raise ModelLoadError(f'failed to load model "{source.name}": not enough memory: it took '
                                     f"{weight_bytes} bytes of weights, more than memory.budget "
                                     f"({self.budget_bytes} bytes) has free while the other models are busy")
            await asyncio.gather(*[self.start_unload(self.loaded[v.name]) for v in victims])
        log.info("loaded model %s in %.2fs%s (%d bytes of weights)", source.name, load_s,
                 " from the warm tier" if warm else "", weight_bytes)
        return LoadedEntry(source, model, weight_bytes, load_s, warm is not None, key, parameter_count,
                           engine=self.engine)

    def _load_blocking(self, source: ModelSource, warm, job: LoadJob):
        if warm is not None:
            model = to_device(warm, self.device)
        else:
            model = self._loader(source.path, self.dtype, self.device, job.report, weights=self.weights_of(source))
        self.engine.add_model(source.name, model, share_weight=source.weight)
        return model

    # ------------------------------------------------------------------ unload

    def start_unload(self, entry: LoadedEntry) -> asyncio.Task:
        """Forget `entry` at once; remove it from the engine (and keep it warm) in a worker thread."""
        log.info("unloading model %s", entry.name)
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        del self.loaded[entry.name]
        task = asyncio.get_running_loop().create_task(self._unload(entry))
        self.unloading[entry.name] = task
        return task

    async def _unload(self, entry: LoadedEntry) -> None:
        keep_warm = self.warm.fits(entry.weight_bytes)
        try:
            model = await asyncio.to_thread(self._unload_blocking, entry, keep_warm)
            if model is not None:
                self.warm.put(entry.warm_key, model, entry.weight_bytes)
        except Exception as e:
            log.error("removing model %s from the engine failed: %s", entry.name, e)
        finally:
            del self.unloading[entry.name]
            self.notify_room()

    def _unload_blocking(self, entry: LoadedEntry, keep_warm: bool):
        self.engine.remove_model(entry.name)
        return to_host(entry.model) if keep_warm else None

    async def close(self) -> None:
        """Fail the loads still waiting for memory, finish the running ones, unload everything."""
        self.closing = True
        self.notify_room()
        for job in list(self.jobs.values()):
            await asyncio.gather(job.task, return_exceptions=True)
        self.warm.resize(0)  # shutting down: nothing to keep warm for
        for entry in list(self.loaded.values()):
            await asyncio.shield(self.start_unload(entry))
