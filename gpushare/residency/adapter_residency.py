"""LoRA adapter models resident on their base: an adapter attaches to its loaded base (only its own
weights move, counted against the base device's memory.budget) and holds a lease on that base for as
long as it is attached, so the base is never evicted nor unloaded under it. Adapters load on demand and
leave by their own keep_alive and LRU, as models do; they never count against max_loaded_models.

Runs on the asyncio loop; the device's attach and detach calls block, in threads.
"""

from __future__ import annotations

import asyncio
import logging
import time

from gpushare.catalog.model_files import without_paths
from gpushare.residency.entries import LoadedEntry, LoadJob, ModelLoadError, RegistryFull
from gpushare.residency.memory_budget import Resident, read_tensor_count
from gpushare.residency.worker_client import WorkerDied

log = logging.getLogger("gpushare.registry")

ADAPTER_BYTES_PER_WEIGHT = 4  # the engine holds A and B in float32 (models/lora.py), whatever the file's type


async def attach(residency, job: LoadJob) -> LoadedEntry:
    """Attach `job`'s adapter to its base (job.base, leased by the caller), waiting for room on the base's
    device; the entry it returns holds a lease on the base."""
    source, base = job.source, job.base
    device = base.device
    job.device = device.name
    count = await read_tensor_count(f'adapter "{source.name}"', source.adapter)
    estimate_bytes = count.parameters * ADAPTER_BYTES_PER_WEIGHT
    evictions = await residency.wait_for_room(job, estimate_bytes)
    job.state = "loading"
    await asyncio.gather(*evictions)
    log.info("attaching adapter %s to %s on %s", source.name, base.name, device.name)
    t0 = time.monotonic()
    try:
        adapter_bytes = await asyncio.to_thread(device.attach_adapter, source.name, base.name, source.adapter)
    except WorkerDied as e:
        raise RegistryFull(f'cannot load adapter "{source.name}" now: {e}; retry', 5) from e
    except Exception as e:
        log.warning("attaching adapter %s (%s) failed: %s", source.name, source.adapter, e)
        raise ModelLoadError(f'failed to load adapter "{source.name}" on base "{base.name}": '
                             f'{without_paths(str(e), source.adapter)}',
                             refused=isinstance(e, (ValueError, OSError))) from e
    load_s = time.monotonic() - t0
    base.active += 1  # held until the adapter detaches (detach gives it back)
    log.info("attached adapter %s to %s in %.2fs (%d bytes)", source.name, base.name, load_s, adapter_bytes)
    return LoadedEntry(source, base.model, adapter_bytes, load_s, False, (source.digest(), "adapter", device.name),
                       adapter_bytes // ADAPTER_BYTES_PER_WEIGHT, device=device, base=base)


async def detach(residency, entry: LoadedEntry) -> None:
    """Detach an adapter from its base, then give the base its lease back."""
    try:
        await asyncio.to_thread(entry.device.detach_adapter, entry.name)
    finally:
        residency.release(entry.base)


def residents(here: list[LoadedEntry]) -> list[Resident]:
    """One device's loaded models and adapters as the eviction plan sees them. A base whose only leases
    are its adapters', all idle, is evictable with them (its size and last use counting theirs; they are
    then not evictable apart); an idle adapter is evictable alone, and never counts as a model."""
    residents, going_with_base = [], set()
    for e in (e for e in here if e.base is None):
        adapters = [a for a in here if a.base is e]
        evictable = (e.active == len(adapters) and not e.source.pinned and not e.device.has_work(e.name)
                     and all(a.active == 0 and not a.source.pinned for a in adapters))
        if evictable:
            going_with_base.update(id(a) for a in adapters)
        residents.append(Resident(e.key, e.size_bytes + (sum(a.size_bytes for a in adapters) if evictable else 0),
                                  max([e.last_used, *(a.last_used for a in adapters)]), evictable))
    residents += [Resident(a.key, a.size_bytes, a.last_used,
                           a.active == 0 and not a.source.pinned and id(a) not in going_with_base, counted=False)
                  for a in here if a.base is not None]
    return residents


def adapters_of(residency, base_name: str) -> list[LoadedEntry]:
    """The adapters attached to (any copy of) model `base_name`."""
    return [e for e in residency.entries() if e.base is not None and e.base.name == base_name]
