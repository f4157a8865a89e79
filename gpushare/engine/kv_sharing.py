"""How the models of one engine share its KV pool: fair shares, borrowing back, idle shedding.

A model may use the whole pool while the others are idle. When another model turns busy and finds
the pool full, it takes memory back by preempting sequences of the model furthest over its fair
share (the pool split by ``share_weight`` among the models with work), and only while it is itself
under its own share, so two busy models settle at their shares instead of taking turns. Memory
moves between models a slab at a time, so the victims are the holders of the lender's slab that
the fewest sequences hold blocks in, newest first: as few preemptions as free a slab.
Sequences of tenants inside their ``kv_reserved`` are never preempted for another model.
A model idle for ``idle_release_s`` drops its cached prefix blocks, which gives its slabs back.
"""

from __future__ import annotations

from gpushare.engine.kv_cache import FREED_BLOCK
from gpushare.engine.scheduler import Scheduler


def _held_bytes(scheduler: Scheduler) -> int:
    return scheduler.pool.num_used * scheduler.pool.block_bytes


def borrow_victim(requester: Scheduler, schedulers: list[Scheduler], weights: list[float]):
    """``(scheduler, sequence)`` to preempt so that ``requester`` can grow, or None."""
    busy = [(s, w) for s, w in zip(schedulers, weights) if s.has_work() or s is requester]
    capacity = requester.pool.device.capacity_bytes
    total_weight = sum(w for _, w in busy)
    share = {id(s): capacity * w / total_weight for s, w in busy}
    if _held_bytes(requester) >= share[id(requester)]:
        return None
    lenders = sorted((s for s, _ in busy if s is not requester and _held_bytes(s) > share[id(s)]),
                     key=lambda s: _held_bytes(s) - share[id(s)], reverse=True)
    for lender in lenders:
        victim = _victim_freeing_a_slab(lender)
        if victim is not None:
            return lender, victim
    return None


def _victim_freeing_a_slab(lender: Scheduler):
    """The newest holder of the lender's slab with the fewest holders, all of them preemptible."""
    pool = lender.pool
    order = {id(seq): i for i, seq in enumerate(lender.running)}
    holders: dict[int, dict[int, object]] = {}  # slab -> {sequence id: sequence}
    for seq in lender.running:
        for block in seq.block_table:
            if block != FREED_BLOCK:  # out of a sliding window, already given back
                holders.setdefault(pool.slab_of(block), {})[id(seq)] = seq
    slabs = [h for h in holders.values() if all(pool.over_reservation(seq.tenant) for seq in h.values())]
    if not slabs:
        return None
    cheapest = min(slabs, key=len)
    return max(cheapest.values(), key=lambda seq: order[id(seq)])


def shed_idle_models(schedulers: list[Scheduler], idle_since_s: dict[int, float], now_s: float,
                     idle_release_s: float) -> int:
    """Give back the slabs of models idle for ``idle_release_s``; returns slabs given back.
    ``idle_since_s`` (by scheduler id) is kept between calls."""
    returned = 0
    for scheduler in schedulers:
        key = id(scheduler)
        if scheduler.has_work():
            idle_since_s.pop(key, None)
            continue
        since = idle_since_s.setdefault(key, now_s)
        if now_s - since >= idle_release_s and scheduler.pool.num_slabs:
            returned += scheduler.pool.shed_cache()
    return returned
