"""Scheduler: picks each step's batch for one model (continuous batching at token level).

A step mixes every running sequence's next tokens (one for a decode, a chunk for a prompt still
being prefilled) with new prompts, within ``max_num_batched_tokens`` and ``max_num_seqs``.
New prompts are admitted interactive tenants first, then by smallest virtual token counter
(weighted fair share across tenants), then oldest first; their cached prefix is reused.
``schedule_urgent`` builds the step the engine runs for the prompts of tenants ahead of all the
running work (``TenantLedger.urgent_tenants``), so that their first token need not wait for it.
When blocks run out a running sequence is preempted (blocks freed, recomputed later) so the
engine never deadlocks: a tenant at its KV limit only ever preempts its own newest sequence;
a short pool takes from tenants above their reservation first, newest first, and, through
``borrow`` (set by the engine, kv_sharing.py), from other models over their share of the device pool.
"""

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from gpushare.engine.kv_cache import BlockPool, blocks_out_of_window
from gpushare.engine.sequence import Sequence, Status


@dataclass
class Batch:
    seqs: list[Sequence] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)  # tokens each sequence computes this step

    def add(self, seq: Sequence, chunk: int):
        self.seqs.append(seq)
        self.chunks.append(chunk)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int, kv_window: int | None = None):
        self.pool = pool
        self.kv_window = kv_window  # every layer slides (ModelConfig.kv_window): blocks behind it are freed
        self.ledger = pool.ledger
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Preempts another model's sequence so this one can grow; False when none may be taken.
        self.borrow: Callable[["Scheduler"], bool] | None = None

    def add(self, seq: Sequence) -> None:
        active = {s.fair_key for s in self.running} | {s.fair_key for s in self.waiting}
        if seq.fair_key not in active:
            self.ledger.activate(seq.fair_key, active)
        self.waiting.append(seq)

    def adopt(self, seq: Sequence) -> None:
        """Take in a sequence forked from a running one (forks.py): running if it holds its blocks."""
        if seq.status is Status.RUNNING:
            self.running.append(seq)
        else:
            self.waiting.appendleft(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        batch = Batch()
        budget = self.max_num_batched_tokens
        for index, seq in enumerate(list(self.running)):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            chunk = min(seq.num_pending, budget)
            while (refused := self.pool.grow(seq.block_table, seq.num_computed + chunk, seq.tenant)) is not None:
                if self._borrowed(refused):
                    continue
                victim = self.victim(seq, refused, batch)
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                batch.add(seq, chunk)
                budget -= chunk
        self._admit(batch, budget)
        return batch

    def schedule_urgent(self, classes: set[tuple[str, str | None]]) -> Batch:
        """A step of these (tenant, request priority) pairs' waiting prompts alone, never growing or
        preempting running sequences: the engine runs it ahead of (or in the middle of) a step of
        other tenants' work."""
        batch = Batch()
        self._admit(batch, self.max_num_batched_tokens, classes)
        return batch

    def _admit(self, batch: Batch, budget: int, only: set[tuple[str, str | None]] | None = None) -> None:
        blocked: set[str] = set()  # tenants that could not get blocks this step
        while budget > 0 and len(self.running) < self.max_num_seqs:
            candidates = [s for s in self.waiting
                          if s.tenant not in blocked and (only is None or (s.fair_key, s.priority) in only)]
            if not candidates:
                return
            seq = min(candidates, key=lambda s: (*self.ledger.admission_key(s.fair_key, s.priority), s.arrival_s))
            hit = self.pool.match_prefix(seq)
            chunk = min(seq.num_pending, budget)
            if not self._grow_for_admission(seq, chunk, borrow=only is None):
                self._reset(seq)
                blocked.add(seq.tenant)
                continue
            seq.num_cached = hit
            if hit:
                self.ledger.prefix_hit_tokens[seq.tenant] = self.ledger.prefix_hit_tokens.get(seq.tenant, 0) + hit
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            if seq.scheduled_time_s is None:  # a preempted sequence's queue time ended at its first admission
                seq.scheduled_time_s = time.monotonic()
            self.running.append(seq)
            batch.add(seq, chunk)
            budget -= chunk

    def _grow_for_admission(self, seq: Sequence, chunk: int, borrow: bool) -> bool:
        """Blocks for a new prompt's first chunk, borrowed from other models when this one is under its
        share (never in an urgent step: the paused step in flight may hold the sequences it would take)."""
        while (refused := self.pool.grow(seq.block_table, seq.num_computed + chunk, seq.tenant)) is not None:
            if not (borrow and self._borrowed(refused)):
                return False
        return True

    def _borrowed(self, refused: str) -> bool:
        """Whether another model gave up a sequence's blocks because this pool ran short."""
        return refused == "pool" and self.borrow is not None and self.borrow(self)

    def victim(self, seq: Sequence, refused: str, batch: Batch | None = None) -> Sequence:
        """Whom to preempt so ``seq`` can grow (``seq`` itself when no one else may be); never a
        sequence already in this step's batch."""
        scheduled = set(map(id, batch.seqs)) if batch else set()
        later = [s for s in self.running if id(s) not in scheduled]
        if refused == "limit":
            own = [s for s in later if s.tenant == seq.tenant]
            return own[-1] if own else seq
        pool = self.pool
        over = [s for s in later if pool.over_reservation(s.tenant)]
        return over[-1] if over else seq

    def _reset(self, seq: Sequence) -> None:
        self.pool.release(seq.block_table, seq.tenant)
        seq.block_keys.clear()
        seq.num_computed = 0

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._reset(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def after_step(self, batch: Batch) -> None:
        """Charge computed tokens to tenants, publish newly filled blocks to the prefix cache, and free
        the blocks that fell out of every layer's sliding window."""
        for seq, chunk in zip(batch.seqs, batch.chunks):
            self.ledger.count_computed(seq.tenant, chunk, seq.fair_key)
            self.pool.register_full_blocks(seq)
            out = blocks_out_of_window(seq.num_computed, self.pool.block_size, self.kv_window)
            if out:
                self.pool.free_leading(seq.block_table, out, seq.tenant)

    def finish(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is and give its blocks back."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        self._reset(seq)
