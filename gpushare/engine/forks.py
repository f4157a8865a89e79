"""n answers to one prompt: after answer 0's prefill, answers 1..n-1 are forked from it.

Each fork shares the prompt's full KV blocks by reference count and gets a copy of the partial
last block (copy on write: the only block the answers would write differently), so n answers hold
the prompt's KV about once instead of n times. A fork that finds no free block for its copy waits
in the queue without blocks and computes its prompt itself later (the prefix cache may still
share it).
"""

from __future__ import annotations

import dataclasses

import torch

from gpushare.engine.kv_cache import BlockPool
from gpushare.engine.sequence import Sequence, Status

SEED_MASK = (1 << 64) - 1


def wants_forks(seq: Sequence) -> bool:
    """True for answer 0 of an n > 1 request whose prompt has just been computed."""
    return seq.params.n > 1 and seq.index == 0 and not seq.forks and not seq.output_ids


def fork(seq: Sequence, pool: BlockPool, copy_block) -> list[Sequence]:
    """Answers 1..n-1 of ``seq`` (answer 0), each RUNNING with the prompt's KV shared, or WAITING
    with no blocks; ``copy_block(source, destination)`` copies one KV block."""
    forks = []
    for index in range(1, seq.params.n):
        child = dataclasses.replace(
            seq, request_id=f"{seq.request_id}-{index}", index=index, output_ids=[], block_table=[],
            block_keys=list(seq.block_keys), forks=[], prompt_logprobs=None, last_logprobs=None,
            matcher=seq.matcher.deep_copy() if seq.matcher is not None else None,
            generator=(torch.Generator(device=seq.generator.device).manual_seed((seq.params.seed + index) & SEED_MASK)
                       if seq.generator is not None else None))
        shared = pool.share(seq.block_table, seq.num_computed, seq.tenant)
        if shared is None:
            child.num_computed = child.num_cached = 0
            child.block_keys = []
            child.status = Status.WAITING
        else:
            child.block_table, copy = shared
            if copy is not None:
                copy_block(*copy)
            child.status = Status.RUNNING
        forks.append(child)
    seq.forks = forks
    return forks
