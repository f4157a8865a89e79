"""Scheduler: picks each step's batch for one model (continuous batching at token level).

A step mixes every running sequence's next tokens (one for a decode, a chunk for a prompt still
being prefilled) with new prompts, within ``max_num_batched_tokens`` and ``max_num_seqs``. When
blocks run out, the newest running sequence is preempted: its blocks are freed and it is
recomputed from its tokens later, so the engine never deadlocks.
"""

from collections import deque
from dataclasses import dataclass, field

from gpushare.engine.kv_cache import BlockPool
from gpushare.engine.sequence import Sequence, Status


@dataclass
class Batch:
    seqs: list[Sequence] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)  # tokens each sequence computes this step

    def add(self, seq: Sequence, chunk: int):
        self.seqs.append(seq)
        self.chunks.append(chunk)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        batch = Batch()
        budget = self.max_num_batched_tokens
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            chunk = min(seq.num_pending, budget)
            while not self.pool.grow(seq.block_table, seq.num_computed + chunk):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                batch.add(seq, chunk)
                budget -= chunk
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            chunk = min(seq.num_pending, budget)
            if not self.pool.grow(seq.block_table, seq.num_computed + chunk):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.add(seq, chunk)
            budget -= chunk
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.release(seq.block_table)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is and give its blocks back."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        self.pool.release(seq.block_table)
