"""The paged KV cache of one model: its blocks in the device pool's slabs, the prefix cache, tenant charges.

A model takes slabs from the device pool (kv_pool.py) as its sequences need blocks and gives a
slab back as soon as no block in it is held or cached; blocks are taken from the fullest slab
first so that the others drain. Tenant rules count bytes over every model: ``kv_limit`` caps a
tenant, and the unused part of other tenants' ``kv_reserved`` is never handed out.

A full block is keyed by a chained hash of (scope, every token up to its end), where the scope is
the tenant (or nothing, for a global cache): identical prefixes share blocks by reference count.
A block whose last holder lets go stays cached, evictable least recently used first, until its
slot is needed. Every block a sequence holds is charged to its tenant, once per tenant.
"""

import hashlib
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from gpushare.engine.kv_pool import DeviceKVPool
from gpushare.protocol.request import KVCacheBusy
from gpushare.engine.tenant_ledger import TenantLedger


# A block-table entry whose block was given back because it fell out of every layer's sliding window;
# later entries keep their index (token t stays in entry t // block_size).
FREED_BLOCK = -1


def blocks_out_of_window(num_computed: int, block_size: int, window: int | None) -> int:
    """How many leading blocks of a sequence no later token can attend to: the next token sits at
    ``num_computed`` and sees keys after ``num_computed - window``. 0 without a window."""
    if not window:
        return 0
    return max(0, num_computed - window + 1) // block_size


def block_hash(previous: bytes, scope: str, tokens) -> bytes:
    return hashlib.blake2b(repr((previous, scope, tuple(tokens))).encode(), digest_size=16).digest()


@dataclass
class BlockPool:
    device: DeviceKVPool
    block_size: int
    block_bytes: int
    ledger: TenantLedger = field(default_factory=TenantLedger)
    prefix_scope: str = "tenant"  # "tenant" | "global" | "off"

    def __post_init__(self):
        self.device.register(self, self.block_bytes)
        self.resized()
        self.slab_free: dict[int, list[int]] = {}  # own slab -> its free blocks
        self.slab_held: dict[int, int] = {}  # own slab -> its blocks held by a sequence
        self.ref_counts: Counter = Counter()
        self.block_keys: dict[int, bytes] = {}
        self.cached: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, LRU first
        self.held: dict[str, Counter] = {}  # tenant -> block -> holders

    def resized(self) -> None:
        """Count the blocks of the device pool again (it was allocated anew: kv_pool.DeviceKVPool.resize)."""
        self.num_blocks = sum(len(self.device.blocks_in(s, self.block_bytes)) for s in range(self.device.num_slabs))

    @property
    def num_free(self) -> int:
        """Blocks this model could have now: free in its slabs, cached but unheld, free slabs, and
        slabs that other models hold only cached blocks in."""
        own = sum(len(free) for free in self.slab_free.values()) + len(self.evictable)
        others = sum(m.sheddable_blocks(self.block_bytes) for m in self.device.members if m is not self)
        return own + self.device.free_blocks_for(self.block_bytes) + others

    @property
    def num_used(self) -> int:
        return sum(self.slab_held.values())

    @property
    def num_slabs(self) -> int:
        return len(self.slab_free)

    @property
    def bytes_per_token(self) -> int:
        return self.block_bytes // self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def tenant_blocks(self, tenant: str) -> int:
        return len(self.held.get(tenant, ()))

    def over_reservation(self, tenant: str) -> bool:
        """Whether the tenant holds more KV, over every model, than its kv_reserved."""
        reserved = self.ledger.policy(tenant).reserved_bytes(self.bytes_per_token)
        return self.ledger.used_bytes.get(tenant, 0) > reserved

    def _set_aside_for_others(self, tenant: str) -> int:
        """Blocks this tenant may not take: the unused reservations of everyone else (node-wide)."""
        ledger = self.ledger
        unmet = sum(max(0, ledger.policy(t).reserved_bytes(self.bytes_per_token) - ledger.used_bytes.get(t, 0))
                    for t in ledger.policies if t != tenant)
        return -(-unmet // self.block_bytes)

    def can_take(self, tenant: str, extra: int) -> str | None:
        """None if ``tenant`` may take ``extra`` more blocks now, else why not: "limit" or "pool"."""
        room = self.ledger.room_bytes(tenant, self.bytes_per_token)
        if room is not None and extra * self.block_bytes > room:
            return "limit"
        if extra > self.num_free - self._set_aside_for_others(tenant):
            return "pool"
        return None

    def _may_hold(self, tenant: str, block: int) -> bool:
        if self.held.get(tenant, Counter())[block]:
            return True  # already charged to this tenant
        room = self.ledger.room_bytes(tenant, self.bytes_per_token)
        return room is None or room >= self.block_bytes

    def slab_of(self, block: int) -> int:
        return block * self.block_bytes // self.device.slab_bytes

    def _take_block(self) -> int:
        """A free block: from the fullest own slab (so emptier ones drain and go back), else a new
        slab, else the least recently used cached block, else a slab another model only caches in."""
        with_free = [s for s, free in self.slab_free.items() if free]
        if not with_free and self._add_slab(shed_others=False):
            with_free = [s for s, free in self.slab_free.items() if free]
        if with_free:
            return self.slab_free[min(with_free, key=lambda s: len(self.slab_free[s]))].pop()
        if self.evictable:
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.block_keys.pop(block)]
            return block
        if self._add_slab(shed_others=True):
            return self._take_block()
        raise KVCacheBusy("the KV pool has no free block")  # can_take said there would be one

    def _add_slab(self, shed_others: bool) -> bool:
        slab = self.device.take(self, shed_others)
        if slab is None:
            return False
        self.slab_free[slab] = list(reversed(self.device.blocks_in(slab, self.block_bytes)))
        self.slab_held[slab] = 0
        return True

    def _return_if_empty(self, slab: int) -> None:
        if self.slab_held[slab] == 0 and len(self.slab_free[slab]) == len(self.device.blocks_in(slab, self.block_bytes)):
            del self.slab_free[slab], self.slab_held[slab]
            self.device.give_back(slab)

    def sheddable_blocks(self, block_bytes: int) -> int:
        """Blocks (of a model with ``block_bytes``) in this model's slabs that hold no block in use."""
        return sum(len(self.device.blocks_in(s, block_bytes)) for s, held in self.slab_held.items() if held == 0)

    def _drop_cached(self, block: int) -> None:
        del self.cached[self.block_keys.pop(block)]
        del self.evictable[block]
        self.slab_free[self.slab_of(block)].append(block)

    def shed_one_slab(self) -> bool:
        """Give back one slab that holds no block in use, dropping its cached blocks; False if none."""
        slab = next((s for s, held in self.slab_held.items() if held == 0), None)
        if slab is None:
            return False
        for block in [b for b in self.evictable if self.slab_of(b) == slab]:
            self._drop_cached(block)
        self._return_if_empty(slab)
        return True

    def shed_cache(self) -> int:
        """Drop every cached block nobody holds and give back the slabs left empty; returns the
        number of slabs given back (an idle model holds no KV memory after this)."""
        before = self.num_slabs
        for block in list(self.evictable):
            self._drop_cached(block)
        for slab in list(self.slab_held):
            self._return_if_empty(slab)
        return before - self.num_slabs

    def close(self) -> None:
        """The model unloads: every slab goes back to the device pool."""
        self.device.unregister(self)
        self.slab_free.clear()
        self.slab_held.clear()

    def _hold(self, tenant: str, block: int) -> None:
        self.ref_counts[block] += 1
        if self.ref_counts[block] == 1:
            self.slab_held[self.slab_of(block)] += 1
        counter = self.held.setdefault(tenant, Counter())
        if counter[block] == 0:
            self.ledger.charge(tenant, self.block_bytes)
        counter[block] += 1

    def grow(self, block_table: list[int], num_tokens: int, tenant: str = "default") -> str | None:
        """Extend ``block_table`` to hold ``num_tokens``, all or nothing; None on success, else why not."""
        extra = self.blocks_for(num_tokens) - len(block_table)
        if extra <= 0:
            return None
        refused = self.can_take(tenant, extra)
        if refused:
            return refused
        for _ in range(extra):
            block = self._take_block()
            self._hold(tenant, block)
            block_table.append(block)
        return None

    def release(self, block_table: list[int], tenant: str = "default") -> None:
        counter = self.held.get(tenant, Counter())
        for block in block_table:
            if block == FREED_BLOCK:
                continue
            counter[block] -= 1
            if counter[block] == 0:
                del counter[block]
                self.ledger.charge(tenant, -self.block_bytes)
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                del self.ref_counts[block]
                slab = self.slab_of(block)
                self.slab_held[slab] -= 1
                if block in self.block_keys:
                    self.evictable[block] = None
                else:
                    self.slab_free[slab].append(block)
                    self._return_if_empty(slab)
        block_table.clear()

    def free_leading(self, block_table: list[int], count: int, tenant: str = "default") -> None:
        """Give back the first ``count`` blocks of ``block_table`` (out of every layer's window),
        leaving FREED_BLOCK in their entries; a cached block stays reusable as a prefix."""
        self.release([b for b in block_table[:count] if b != FREED_BLOCK], tenant)
        block_table[:count] = [FREED_BLOCK] * min(count, len(block_table))

    def share(self, block_table: list[int], num_tokens: int, tenant: str
              ) -> tuple[list[int], tuple[int, int] | None] | None:
        """A block table for a copy of a sequence (one of ``n`` answers) whose first ``num_tokens``
        tokens are in ``block_table``: its full blocks shared by reference count (blocks already out
        of a sliding window stay FREED_BLOCK), its partial last block (the copy writes into it) a
        fresh block. Returns (table, (source, destination) block pair to copy, or None), or None when
        no block is free for the copy."""
        full = num_tokens // self.block_size
        partial = len(block_table[:self.blocks_for(num_tokens)]) > full
        if partial and self.can_take(tenant, 1) is not None:
            return None
        table = list(block_table[:full])
        for block in table:
            if block != FREED_BLOCK:
                self._hold(tenant, block)
        if not partial:
            return table, None
        fresh = self._take_block()
        self._hold(tenant, fresh)
        table.append(fresh)
        return table, (block_table[full], fresh)

    # ---- prefix cache ----------------------------------------------------------------------
    def _scope(self, seq) -> str | None:
        """Which cached blocks ``seq`` may share: its tenant's (or everyone's), and only of its own adapter,
        since an adapter changes every layer's K and V."""
        if self.prefix_scope == "off":
            return None
        scope = seq.tenant if self.prefix_scope == "tenant" else ""
        return scope if seq.adapter is None else f"{scope}\x00adapter:{seq.adapter}"

    def match_prefix(self, seq) -> int:
        """Reuse cached blocks for ``seq``'s leading full prompt blocks; returns tokens reused.

        The last prompt token is always computed, since its logits pick the first new token. A
        sequence that asked for prompt logprobs computes its whole prompt: each row scores a token.
        """
        scope = self._scope(seq)
        if scope is None or seq.num_computed or seq.block_table or seq.prompt_logprobs is not None:
            return 0
        tokens = seq.all_ids
        reused, key = 0, b""
        for start in range(0, len(tokens) - 1 - self.block_size + 1, self.block_size):
            key = block_hash(key, scope, tokens[start:start + self.block_size])
            block = self.cached.get(key)
            if block is None or not self._may_hold(seq.tenant, block):
                break
            self.evictable.pop(block, None)
            self._hold(seq.tenant, block)
            seq.block_table.append(block)
            seq.block_keys.append(key)
            reused += self.block_size
        seq.num_computed = reused
        return reused

    def register_full_blocks(self, seq) -> None:
        """Publish the blocks ``seq`` has filled since the last call, so later prompts can reuse them."""
        scope = self._scope(seq)
        if scope is None:
            return
        tokens = seq.all_ids
        while len(seq.block_keys) < seq.num_computed // self.block_size:
            i = len(seq.block_keys)
            previous = seq.block_keys[-1] if seq.block_keys else b""
            key = block_hash(previous, scope, tokens[i * self.block_size:(i + 1) * self.block_size])
            seq.block_keys.append(key)
            block = seq.block_table[i]
            if block != FREED_BLOCK and key not in self.cached and block not in self.block_keys:
                self.cached[key] = block
                self.block_keys[block] = key
