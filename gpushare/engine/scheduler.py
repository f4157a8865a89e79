"""Scheduler: picks each step's batch for one model (continuous batching at token level).

A step mixes every running sequence's next tokens (one for a decode, a chunk for a prompt still
being prefilled) with new prompts, within ``max_num_batched_tokens`` and ``max_num_seqs``.
New prompts are admitted interactive tenants first, then by smallest virtual token counter
(weighted fair share across tenants), then oldest first; their cached prefix is reused.
``schedule_urgent`` builds the step the engine runs for the prompts of tenants ahead of all the
running work (``TenantLedger.urgent_tenants``), so that their first token need not wait for it.
When blocks run out a running sequence is preempted (blocks freed, recomputed later) so the
engine never deadlocks: a tenant at its KV limit only ever preempts its own newest sequence;
a short pool takes from tenants above their reservation first, newest first.
"""

from collections import deque
from dataclasses import dataclass, field

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

    def add(self, seq: Sequence) -> None:
        active = {s.tenant for s in self.running} | {s.tenant for s in self.waiting}
        if seq.tenant not in active:
            self.ledger.activate(seq.tenant, active)
        self.waiting.append(seq)

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
                victim = self.victim(seq, refused, batch)
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                batch.add(seq, chunk)
                budget -= chunk
        self._admit(batch, budget)
        return batch

    def schedule_urgent(self, tenants: set[str]) -> Batch:
        """A step of these tenants' waiting prompts alone, never growing or preempting running
        sequences: the engine runs it ahead of (or in the middle of) a step of other tenants' work."""
        batch = Batch()
        self._admit(batch, self.max_num_batched_tokens, tenants)
        return batch

    def _admit(self, batch: Batch, budget: int, only: set[str] | None = None) -> None:
        blocked: set[str] = set()  # tenants that could not get blocks this step
        while budget > 0 and len(self.running) < self.max_num_seqs:
            candidates = [s for s in self.waiting if s.tenant not in blocked and (only is None or s.tenant in only)]
            if not candidates:
                return
            seq = min(candidates, key=lambda s: (*self.ledger.admission_key(s.tenant), s.arrival_s))
            hit = self.pool.match_prefix(seq)
            chunk = min(seq.num_pending, budget)
            if self.pool.grow(seq.block_table, seq.num_computed + chunk, seq.tenant) is not None:
                self._reset(seq)
                blocked.add(seq.tenant)
                continue
            seq.num_cached = hit
            if hit:
                self.ledger.prefix_hit_tokens[seq.tenant] = self.ledger.prefix_hit_tokens.get(seq.tenant, 0) + hit
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.add(seq, chunk)
            budget -= chunk

    def victim(self, seq: Sequence, refused: str, batch: Batch | None = None) -> Sequence:
        """Whom to preempt so ``seq`` can grow (``seq`` itself when no one else may be); never a
        sequence already in this step's batch."""
        scheduled = set(map(id, batch.seqs)) if batch else set()
        later = [s for s in self.running if id(s) not in scheduled]
        if refused == "limit":
            own = [s for s in later if s.tenant == seq.tenant]
            return own[-1] if own else seq
        pool = self.pool
        over = [s for s in later if pool.tenant_blocks(s.tenant) > pool.reserved_blocks(s.tenant)]
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
            self.ledger.count_computed(seq.tenant, chunk)
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
