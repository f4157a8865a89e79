"""The paged KV cache of one model: block tensors, the free list, the prefix cache, tenant charges.

A full block is keyed by a chained hash of (scope, every token up to its end), where the scope is
the tenant (or nothing, for a global cache): identical prefixes share blocks by reference count.
A block whose last holder lets go stays cached, evictable least recently used first, until its
slot is needed. Every block a sequence holds is charged to its tenant, once per tenant.
"""

import hashlib
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

import torch

from gpushare.engine.tenants import TenantLedger
from gpushare.models.config import ModelConfig


# A block-table entry whose block was given back because it fell out of every layer's sliding window;
# later entries keep their index (token t stays in entry t // block_size).
FREED_BLOCK = -1


def blocks_out_of_window(num_computed: int, block_size: int, window: int | None) -> int:
    """How many leading blocks of a sequence no later token can attend to: the next token sits at
    ``num_computed`` and sees keys after ``num_computed - window``. 0 without a window."""
    if not window:
        return 0
    return max(0, num_computed - window + 1) // block_size


class KVCacheBusy(RuntimeError):
    """The blocks a request needs now are held by requests it may not preempt."""


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return config.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size()) * block_size


def allocate_kv_tensors(config: ModelConfig, num_blocks: int, block_size: int, dtype, device) -> list:
    """Per layer a (K, V) pair of ``[num_blocks, block_size, num_kv_heads, head_dim]`` views."""
    cache = torch.zeros(config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim,
                        dtype=dtype, device=device)
    return [(cache[i, 0], cache[i, 1]) for i in range(config.num_layers)]


def block_hash(previous: bytes, scope: str, tokens) -> bytes:
    return hashlib.blake2b(repr((previous, scope, tuple(tokens))).encode(), digest_size=16).digest()


@dataclass
class BlockPool:
    num_blocks: int
    block_size: int
    block_bytes: int = 0
    ledger: TenantLedger = field(default_factory=TenantLedger)
    prefix_scope: str = "tenant"  # "tenant" | "global" | "off"

    def __post_init__(self):
        self.free_blocks = deque(range(self.num_blocks))
        self.ref_counts = [0] * self.num_blocks
        self.block_keys: list[bytes | None] = [None] * self.num_blocks
        self.cached: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, LRU first
        self.held: dict[str, Counter] = {}  # tenant -> block -> holders

    @property
    def num_free(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def bytes_per_token(self) -> int:
        return self.block_bytes // self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def tenant_blocks(self, tenant: str) -> int:
        return len(self.held.get(tenant, ()))

    def reserved_blocks(self, tenant: str) -> int:
        reserved = self.ledger.policy(tenant).reserved_bytes(self.bytes_per_token)
        return -(-reserved // self.block_bytes) if self.block_bytes else 0

    def _set_aside_for_others(self, tenant: str) -> int:
        """Free blocks this tenant may not take: the unused reservations of everyone else."""
        return sum(max(0, self.reserved_blocks(t) - self.tenant_blocks(t))
                   for t in self.ledger.policies if t != tenant)

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

    def _take_block(self) -> int:
        if self.free_blocks:
            return self.free_blocks.popleft()
        block, _ = self.evictable.popitem(last=False)
        del self.cached[self.block_keys[block]]
        self.block_keys[block] = None
        return block

    def _hold(self, tenant: str, block: int) -> None:
        self.ref_counts[block] += 1
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
                if self.block_keys[block] is None:
                    self.free_blocks.append(block)
                else:
                    self.evictable[block] = None
        block_table.clear()

    def free_leading(self, block_table: list[int], count: int, tenant: str = "default") -> None:
        """Give back the first ``count`` blocks of ``block_table`` (out of every layer's window),
        leaving FREED_BLOCK in their entries; a cached block stays reusable as a prefix."""
        self.release([b for b in block_table[:count] if b != FREED_BLOCK], tenant)
        block_table[:count] = [FREED_BLOCK] * min(count, len(block_table))

    # ---- prefix cache ----------------------------------------------------------------------
    def _scope(self, tenant: str) -> str | None:
        return None if self.prefix_scope == "off" else (tenant if self.prefix_scope == "tenant" else "")

    def match_prefix(self, seq) -> int:
        """Reuse cached blocks for ``seq``'s leading full prompt blocks; returns tokens reused.

        The last prompt token is always computed, since its logits pick the first new token. A
        sequence that asked for prompt logprobs computes its whole prompt: each row scores a token.
        """
        scope = self._scope(seq.tenant)
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
        scope = self._scope(seq.tenant)
        if scope is None:
            return
        tokens = seq.all_ids
        while len(seq.block_keys) < seq.num_computed // self.block_size:
            i = len(seq.block_keys)
            previous = seq.block_keys[-1] if seq.block_keys else b""
            key = block_hash(previous, scope, tokens[i * self.block_size:(i + 1) * self.block_size])
            seq.block_keys.append(key)
            block = seq.block_table[i]
            if block != FREED_BLOCK and key not in self.cached and self.block_keys[block] is None:
                self.cached[key] = block
                self.block_keys[block] = key
