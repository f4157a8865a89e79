"""Embedding one input on the engine thread: a forward pass over KV blocks it borrows."""

from gpushare.protocol.request import KVCacheBusy
from gpushare.engine.sequence import Sequence


def embed_one(scheduler, runner, seq: Sequence) -> list[float]:
    """The input's mean-pooled, L2-normalised vector (ModelRunner.embed). Its blocks are charged to its
    tenant for the one pass, and preemption for them follows the same rules as for a prompt; KVCacheBusy
    when even that cannot make room."""
    pool = scheduler.pool
    while (refused := pool.grow(seq.block_table, seq.num_tokens, seq.tenant)) is not None:
        victim = scheduler.victim(seq, refused)
        if victim is seq:
            raise KVCacheBusy(f"no room in the KV cache for the input now ({refused} reached); retry later")
        scheduler.preempt(victim)
    try:
        return runner.embed(seq)
    finally:
        pool.release(seq.block_table, seq.tenant)
