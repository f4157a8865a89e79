"""The KV pool's size on a GPU: what the device leaves free after the resident weights, less
memory.device_margin, never under memory.kv_budget (the part of memory.budget the registry keeps
for it, so that a load always finds the room the registry planned for its weights).

A GPU buffer cannot commit pages as they are written, as the CPU's mapping does (kv_pool.py), so
the pool changes size by being allocated anew, which loses what it holds: every running sequence
is preempted (it recomputes its KV when scheduled again) and cached prefixes are dropped first.
- before a load: back to the floor, so that the weights fit (Engine.fit_kv_pool(floor=True));
- once a model is added: grown into what its weights left;
- once a model is removed: grown at the next idle check when no sequence holds a slab (its
  weights are freed, or moved to the warm tier, only after remove_model returns).
On the CPU none of this runs: the mapping is sized once and its pages follow use. Nor on a
tensor-parallel group: the other ranks' pools mirror the first's block for block.
"""

import torch

from gpushare.engine.device_memory import device_memory

MIN_GROWTH_BYTES = 256 << 20  # a smaller change is not worth preempting every running sequence


def target_bytes(capacity_bytes: int, free_bytes: int, margin_bytes: int, floor_bytes: int) -> int:
    """The pool's size on a device with ``free_bytes`` free beside the pool's own ``capacity_bytes``."""
    return max(floor_bytes, capacity_bytes + free_bytes - margin_bytes)


def elastic(engine) -> bool:
    return engine.config.device.startswith("cuda") and engine.kv_pool.on_decommit is None


def resize(engine, capacity_bytes: int) -> None:
    """On the engine thread: the pool allocated anew at ``capacity_bytes``; every model's KV is dropped
    (its running sequences preempted) and its views into the pool made again."""
    if capacity_bytes == engine.kv_pool.capacity_bytes:
        return
    residents = list(engine.models.values())
    for resident in residents:
        scheduler = resident.scheduler
        for seq in list(scheduler.running):
            scheduler.preempt(seq)
        scheduler.pool.shed_cache()
        resident.runner.kv_caches = []  # the old buffer is freed only once no view holds it
    engine.kv_pool.resize(capacity_bytes)
    for resident in residents:
        resident.runner.kv_caches = engine.kv_pool.layer_views(resident.loaded.config, engine.config.block_size,
                                                               engine.kv_dtype)
    engine.flush()


def fit(engine, floor: bool = False, force: bool = True) -> bool:
    """On the engine thread: on a GPU, the pool sized to what the device leaves (``floor``: to
    memory.kv_budget). ``force`` False: only if no sequence holds a slab now. Whether it was sized."""
    if not elastic(engine):
        return True
    pool = engine.kv_pool
    if not force and any(owner is not None and owner.num_used for owner in pool.owners):
        return False
    if floor:
        resize(engine, engine.config.kv_cache_bytes)
        return True
    torch.cuda.empty_cache()  # freed weights back to the driver, or mem_get_info does not count them
    free = device_memory(engine.config.device).free_bytes
    target = target_bytes(pool.capacity_bytes, free, engine.config.device_margin_bytes, engine.config.kv_cache_bytes)
    if abs(target - pool.capacity_bytes) >= MIN_GROWTH_BYTES or target < pool.capacity_bytes:
        resize(engine, target)
    return True
