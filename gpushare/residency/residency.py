"""The models resident on the node's devices and the memory they hold: placement, load jobs,
evictions, unloads.

Placement: a model loads on one device: the one its `models[].device` names, else the healthy
device where it fits now (counting what idle models' unloading frees) with the least outstanding
work (requests running and queued, from its latest snapshot, plus leases), else the one with the
most free memory, where it waits for room. The budget, max_loaded_models, LRU and keep_alive hold
per device. A model with `models[].replicas` N gets further copies on other devices, loaded in the
background once it is in use (`grow_replicas`); the registry sends each request to the copy with
the fewest tokens outstanding (prompt plus max_tokens of the requests it holds).

One load job per model: concurrent requests for it wait on the same job, and the moment it
has loaded each of them holds a lease (so nothing can evict it between the load and their
first step). A job sizes the model from its file (memory_budget; the real size replaces
the estimate after the first load), waits for room in memory.budget (the engine's KV pool,
memory.kv_budget, counts once; then the weights of every loaded model; and max_loaded_models), unloading idle models least recently used
first, never a pinned one nor one with running or queued requests; then it loads the
model in a worker thread, from the warm tier when it is there, else from its file with
progress. With no idle model to unload it waits up to `room_wait_timeout_s` (RegistryFull,
503 with Retry-After); a model that can never fit or a load that fails raises
ModelLoadError and frees what it took. Unloaded models go to the warm tier. A LoRA adapter's job
attaches it to its leased base instead (adapter_residency.py).

Everything here runs on the asyncio loop; devices' blocking load and unload calls run in threads.
"""

from __future__ import annotations

import asyncio
import logging
import time

from gpushare.catalog.model_files import without_paths
from gpushare.residency import adapter_residency
from gpushare.residency.entries import LoadedEntry, LoadJob, ModelLoadError, RegistryFull
from gpushare.residency.memory_budget import Resident, estimate_weight_bytes, plan_evictions, read_tensor_count
from gpushare.catalog.model_catalog import ModelSource
from gpushare.residency.warm_cache import WarmCache
from gpushare.residency.worker_client import WorkerDied
from gpushare.protocol.weight_format import resolve_weights

log = logging.getLogger("gpushare.registry")

ROOM_WAIT_TIMEOUT_S = 300.0  # as Ollama's OLLAMA_LOAD_TIMEOUT: how long a load waits for busy models
DEVICE_POLL_S = 1.0  # how often a load waiting for an unhealthy device looks again


class Residency:
    def __init__(self, devices: dict, *, dtype: str, weights: str, on_loaded, release, find_device=None):
        self.devices = devices  # name -> device (protocol/device.py), in engine.devices order
        self.dtype = dtype
        self.weights = weights  # engine.weights: the format of models whose entry names none
        self._on_loaded = on_loaded  # (LoadedEntry) -> None, when a job has put a model in
        self.release = release  # (LoadedEntry) -> None, to give a lease back
        self._find_device = find_device or (lambda text: text)  # models[].device as written -> device name
        self.model_groups: dict[str, str] = {}  # tensor-parallel model -> its group's device (group_client.py)
        self.loaded: dict[str, LoadedEntry] = {}  # each model's first copy, by name
        self.replicas: dict[str, list[LoadedEntry]] = {}  # its further copies, on other devices
        self.jobs: dict[str, LoadJob] = {}
        self.unloading: dict[str, asyncio.Task] = {}  # by LoadedEntry.key
        self.unloading_entries: list[LoadedEntry] = []
        self.warm = WarmCache(0, on_drop=self._drop_warm)
        self.budget_bytes = 0  # memory.budget, per device
        self.max_models = 1  # memory.max_loaded_models, per device
        self.is_healthy = lambda device: True  # the daemon's DeviceSupervisor.healthy: placement avoids the rest
        self.room_wait_timeout_s = ROOM_WAIT_TIMEOUT_S
        self.closing = False
        self._sizes: dict[tuple, tuple[int, int]] = {}  # warm key -> (weight bytes, parameter count)
        self._room_changed = asyncio.Event()

    def kind(self, device: str) -> str:
        """"cuda" or "cpu": what torch calls the device inside its engine."""
        return self.devices[device].config.device

    def weights_of(self, source: ModelSource) -> str:
        """The weight format setting for `source` (models[].weights, else engine.weights; may be auto)."""
        return source.weights or self.weights

    def warm_key(self, source: ModelSource, device: str) -> tuple:
        return (source.digest(), self.dtype, self.weights_of(source), device)

    def entries(self) -> list[LoadedEntry]:
        """Every loaded copy of every model."""
        return list(self.loaded.values()) + [e for copies in self.replicas.values() for e in copies]

    def copies(self, name: str) -> list[LoadedEntry]:
        first = self.loaded.get(name)
        return ([first] if first is not None else []) + self.replicas.get(name, [])

    def holds(self, entry: LoadedEntry) -> bool:
        return any(e is entry for e in self.copies(entry.name))

    def _forget(self, entry: LoadedEntry) -> None:
        """Drop `entry` from the loaded copies; a further copy becomes the first when it was the first."""
        if self.loaded.get(entry.name) is entry:
            rest = self.replicas.pop(entry.name, [])
            if rest:
                self.loaded[entry.name] = rest.pop(0)
                if rest:
                    self.replicas[entry.name] = rest
            else:
                del self.loaded[entry.name]
        else:
            self.replicas[entry.name] = [e for e in self.replicas.get(entry.name, []) if e is not entry]
            if not self.replicas[entry.name]:
                del self.replicas[entry.name]

    def is_warm(self, source: ModelSource) -> bool:
        return any(self.warm_key(source, d) in self.warm for d in self.devices)

    def _own_bytes(self, device: str) -> int:
        return (self.devices[device].kv_pool_bytes
                + sum(e.size_bytes for e in self.entries() if e.device_name == device)
                + sum(j.reserved_bytes for j in self.jobs.values() if j.device == device))

    def used_bytes(self, device: str) -> int:
        """memory.budget in use on `device`: its engine's KV pool, its loaded models, the loads that found room.
        A tensor-parallel group's ranks share their devices with those devices' own workers: each
        counts the other (a group, per rank, against its fullest device)."""
        handle = self.devices[device]
        if handle.world_size > 1:
            return self._own_bytes(device) + max(self._own_bytes(m) for m in handle.members)
        return self._own_bytes(device) + sum(self._own_bytes(g) for g, other in self.devices.items()
                                             if other.world_size > 1 and device in other.members)

    def model_count(self, device: str) -> int:
        """The models loaded on `device`, as max_loaded_models counts them: adapters are not."""
        return sum(1 for e in self.entries() if e.device_name == device and e.base is None)

    def residents(self, device: str) -> list[Resident]:
        return adapter_residency.residents([e for e in self.entries() if e.device_name == device])

    def _entry(self, key: str) -> LoadedEntry:
        return next(e for e in self.entries() if e.key == key)

    def outstanding(self, device: str) -> int:
        """Requests on `device`: leases held on its models and loads heading there."""
        return (sum(e.active for e in self.entries() if e.device_name == device)
                + sum(j.waiters for j in self.jobs.values() if j.device == device))

    def place(self, source: ModelSource, need_bytes: int, exclude: set[str] = frozenset()) -> str | None:
        """The device `source` loads on (see the module docstring), never one of `exclude`; None when
        only those are left."""
        if source.name in self.model_groups:
            return self.model_groups[source.name]
        if source.device is not None:
            return self._find_device(source.device)
        candidates = [d for d in self.devices if d not in exclude and self.devices[d].world_size == 1]
        healthy = [d for d in candidates if self.is_healthy(d)] or candidates
        if not healthy:
            return None

        def fits_now(device: str) -> bool:
            counted = self.model_count(device)
            return plan_evictions(self.residents(device), need_bytes, self.used_bytes(device), self.budget_bytes,
                                  self.max_models, counted) is not None

        fitting = [d for d in healthy if fits_now(d)]
        if fitting:
            return min(fitting, key=lambda d: (self.outstanding(d), -(self.budget_bytes - self.used_bytes(d))))
        return max(healthy, key=lambda d: self.budget_bytes - self.used_bytes(d))

    def forget_device(self, device: str) -> list[LoadedEntry]:
        """`device`'s worker died: its models and warm entries are gone. Returns the entries dropped."""
        gone = [e for e in self.entries() if e.device_name == device]
        for entry in gone:
            if entry.timer is not None:
                entry.timer.cancel()
                entry.timer = None
            self._forget(entry)
        self.warm.drop_device(device)
        self.notify_room()
        return gone

    def _drop_warm(self, key: tuple) -> None:
        device = self.devices.get(key[-1])
        if device is not None:
            device.drop_warm(key)

    def notify_room(self) -> None:
        """Wake the loads waiting for memory (and requests waiting for an old model to leave)."""
        self._room_changed.set()
        self._room_changed = asyncio.Event()

    async def room_changed(self) -> None:
        await self._room_changed.wait()

    def evict_over_limits(self) -> None:
        """After the limits shrank: unload idle models, least recently used first, until they hold."""
        for device in self.devices:
            count = self.model_count(device)
            victims = plan_evictions(self.residents(device), 0, self.used_bytes(device), self.budget_bytes,
                                     self.max_models + 1, count)
            for victim in victims or []:
                self.start_unload(self._entry(victim.name))

    # ------------------------------------------------------------------ load

    async def join(self, source: ModelSource, max_waiters: int, base: LoadedEntry | None = None) -> LoadedEntry:
        """Wait for `source` to load (starting its job if none runs); returns holding a lease on it. An
        adapter attaches to `base`, which the caller holds a lease on meanwhile (adapter_residency.py)."""
        while True:
            entry = self.loaded.get(source.name)
            if entry is not None and not entry.retired:
                entry.active += 1
                return entry
            if entry is not None or any(e.name == source.name for e in self.unloading_entries):  # it must leave first
                await self.room_changed()
                continue
            job = self.jobs.get(source.name)
            if job is None:
                job = self.jobs[source.name] = LoadJob(source, base=base)
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
                    self.release(job.task.result())  # loaded just as we left: give our lease back
                else:
                    job.waiters -= 1
                raise

    def grow_replicas(self, source: ModelSource) -> None:
        """Load one more copy of `source` in the background while it has under `source.replicas` (and a device is free)."""
        job_key = f"{source.name}@replica"
        if len(self.copies(source.name)) >= source.replicas or job_key in self.jobs or self.closing:
            return
        job = self.jobs[job_key] = LoadJob(source, replica=True)
        job.task = asyncio.get_running_loop().create_task(self._run(job, job_key))
        job.task.add_done_callback(_log_replica_failure)

    async def _run(self, job: LoadJob, job_key: str | None = None) -> LoadedEntry:
        source = job.source
        try:
            entry = await (adapter_residency.attach(self, job) if job.base is not None else self._place_and_load(job))
            entry.active = job.waiters  # each waiting request holds a lease from this moment
            if job.replica and self.loaded.get(source.name) is not None:
                self.replicas.setdefault(source.name, []).append(entry)
            else:
                self.loaded[source.name] = entry
            self._on_loaded(entry)
            return entry
        finally:
            del self.jobs[job_key or source.name]
            self.notify_room()

    async def _place_and_load(self, job: LoadJob) -> LoadedEntry:
        source = job.source
        estimate_bytes, parameter_count = await self._size(source, next(iter(self.devices)))
        job.device = self.place(source, estimate_bytes, {e.device_name for e in self.copies(source.name)})
        if job.device is None:
            raise ModelLoadError(f'no device is left for another copy of model "{source.name}"')
        estimate_bytes, parameter_count = await self._size(source, job.device)  # its weight format there
        key = self.warm_key(source, job.device)
        evictions = await self.wait_for_room(job, estimate_bytes)
        job.state = "loading"
        await asyncio.gather(*evictions, *self.unloading.values())
        return await self._load(job, key, estimate_bytes, parameter_count)

    async def _size(self, source: ModelSource, device: str) -> tuple[int, int]:
        """(estimated weight bytes, per rank of a tensor-parallel group, and parameter count) of `source` on
        `device`, from its tensor table."""
        key = self.warm_key(source, device)
        if key not in self._sizes:
            count = await read_tensor_count(f'model "{source.name}"', source.path)
            weights = resolve_weights(self.weights_of(source), self.kind(device), set(count.source_types))
            per_rank_bytes = -(-estimate_weight_bytes(count, weights) // self.devices[device].world_size)
            self._sizes[key] = (per_rank_bytes, count.parameters)
        return self._sizes[key]

    async def wait_for_room(self, job: LoadJob, need_bytes: int) -> list[asyncio.Task]:
        """Reserve `need_bytes` of the budget, starting the unloads that make room; waits while busy
        models hold it. ModelLoadError when it could never fit, RegistryFull after the wait timeout.
        Adapters count in bytes only, never against max_loaded_models."""
        source, device = job.source, job.device
        deadline = time.monotonic() + self.room_wait_timeout_s
        while True:
            if self.closing:
                raise RegistryFull(f'cannot load model "{source.name}": the daemon is stopping', 5)
            if not self.is_healthy(device):  # its worker is restarting (or NVML reports faults): wait
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    raise RegistryFull(f'cannot load model "{source.name}": its device {device} stayed unhealthy '
                                       f"(its engine worker restarting, or GPU faults); retry later", 5)
                try:
                    await asyncio.wait_for(self.room_changed(), min(remaining_s, DEVICE_POLL_S))
                except asyncio.TimeoutError:
                    pass
                continue
            here = [e for e in self.entries() if e.device_name == device]
            pinned_bytes = sum(e.size_bytes for e in here if e.source.pinned)
            kv_pool_bytes = self.devices[device].kv_pool_bytes
            if need_bytes + pinned_bytes + kv_pool_bytes > self.budget_bytes:
                raise ModelLoadError(
                    f'failed to load model "{source.name}": not enough memory on device {device}: it needs '
                    f"{need_bytes} bytes of weights, memory.budget is {self.budget_bytes} bytes, the KV pool "
                    f"(memory.kv_budget) takes {kv_pool_bytes} and pinned models hold {pinned_bytes}")
            reserving = sum(1 for j in self.jobs.values() if j.reserved_bytes and j.device == device and not j.base)
            counted = 0 if job.base is not None else self.model_count(device) + reserving
            victims = plan_evictions(self.residents(device), need_bytes, self.used_bytes(device), self.budget_bytes,
                                     self.max_models, counted)
            if victims is not None:
                job.reserved_bytes = need_bytes
                return [self.start_unload(self._entry(v.name)) for v in victims]
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                # The busy models by number only: their names may be outside the asker's allow-list.
                busy = [e.name for e in here if e.active]
                log.info("load of %s gave up waiting for room on %s; busy: %s", source.name, device,
                         ", ".join(busy) or "none")
                raise RegistryFull(f'cannot load model "{source.name}": it needs {need_bytes} bytes, '
                                   f"{self.budget_bytes - self.used_bytes(device)} are free in memory.budget on "
                                   f"device {device} ({self.budget_bytes} bytes, max_loaded_models "
                                   f"{self.max_models}) and the {len(busy)} busy models holding the rest stayed "
                                   f"busy; retry later", 5)
            try:
                await asyncio.wait_for(self.room_changed(), remaining_s)
            except asyncio.TimeoutError:
                pass

    async def _load(self, job: LoadJob, key: tuple, estimate_bytes: int, parameter_count: int) -> LoadedEntry:
        source, device = job.source, self.devices[job.device]
        warm = self.warm.take(key)
        log.info("loading model %s on %s from %s (estimated %d bytes of weights)", source.name, device.name,
                 "the warm tier" if warm else source.path, estimate_bytes)
        t0 = time.monotonic()
        try:
            model, weight_bytes, was_warm = await asyncio.to_thread(
                device.load, source.name, source.path, self.dtype, self.weights_of(source), source.weight, job.report,
                warm, key)
        except WorkerDied as e:  # not the model's fault: the device's worker died meanwhile
            raise RegistryFull(f'cannot load model "{source.name}" now: {e}; retry', 5) from e
        except Exception as e:
            log.warning("loading %s (%s) failed: %s", source.name, source.path, e)
            raise ModelLoadError(f'failed to load model "{source.name}": {without_paths(str(e), source.path)}',
                                 refused=isinstance(e, (ValueError, OSError))) from e
        load_s = time.monotonic() - t0
        rank_bytes = -(-weight_bytes // device.world_size)
        self._sizes[key] = (rank_bytes, parameter_count)
        job.reserved_bytes = rank_bytes
        if rank_bytes > estimate_bytes:  # the estimate was low: unload more idle models, or give it all back
            victims = plan_evictions(self.residents(device.name), 0, self.used_bytes(device.name), self.budget_bytes,
                                     1, 0)
            if victims is None:
                await asyncio.to_thread(device.unload, source.name, model, None)
                raise ModelLoadError(f'failed to load model "{source.name}": not enough memory: it took '
                                     f"{weight_bytes} bytes of weights, more than memory.budget "
                                     f"({self.budget_bytes} bytes) has free on device {device.name} while the "
                                     f"other models are busy")
            await asyncio.gather(*[self.start_unload(self._entry(v.name)) for v in victims])
        log.info("loaded model %s on %s in %.2fs%s (%d bytes of weights)", source.name, device.name, load_s,
                 " from the warm tier" if was_warm else "", weight_bytes)
        return LoadedEntry(source, model, weight_bytes, load_s, was_warm, key, parameter_count, device=device)

    # ------------------------------------------------------------------ unload

    def start_unload(self, entry: LoadedEntry) -> asyncio.Task:
        """Forget `entry` at once; remove it from the engine (and keep it warm) in a worker thread."""
        log.info("unloading model %s from %s", entry.name, entry.device_name)
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        self._forget(entry)
        adapters = [self.start_unload(a) for a in self.entries() if a.base is entry]  # detached before it goes
        task = asyncio.get_running_loop().create_task(self._unload(entry, adapters))
        self.unloading[entry.key] = task
        self.unloading_entries.append(entry)
        return task

    async def _unload(self, entry: LoadedEntry, adapters: list[asyncio.Task]) -> None:
        warm_key = entry.warm_key if self.warm.fits(entry.weight_bytes) and entry.base is None else None
        try:
            await asyncio.gather(*adapters)
            if entry.base is not None:
                await adapter_residency.detach(self, entry)
                return
            kept = await asyncio.to_thread(entry.device.unload, entry.name, entry.model, warm_key)
            if kept is not None:
                self.warm.put(entry.warm_key, kept, entry.weight_bytes, entry.name)
        except Exception as e:
            log.error("removing model %s from device %s failed: %s", entry.name, entry.device_name, e)
        finally:
            del self.unloading[entry.key]
            self.unloading_entries.remove(entry)
            self.notify_room()

    async def close(self) -> None:
        """Fail the loads still waiting for memory, finish the running ones, unload everything."""
        self.closing = True
        self.notify_room()
        for job in list(self.jobs.values()):
            await asyncio.gather(job.task, return_exceptions=True)
        self.warm.resize(0)  # shutting down: nothing to keep warm for
        for entry in sorted(self.entries(), key=lambda e: e.base is None):  # adapters before their bases
            await asyncio.shield(self.start_unload(entry))


def _log_replica_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("another copy could not load: %s", task.exception())
