"""The paged KV cache of one model: block tensors carved from a byte budget, and the free list."""

from collections import deque
from dataclasses import dataclass

import torch

from gpushare.models.config import ModelConfig


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return config.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size()) * block_size


def allocate_kv_tensors(config: ModelConfig, num_blocks: int, block_size: int, dtype, device) -> list:
    """Per layer a (K, V) pair of ``[num_blocks, block_size, num_kv_heads, head_dim]`` views.

    Zero-filled: padded attention reads of never-written slots must be finite (0 x NaN is NaN).
    """
    cache = torch.zeros(config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim,
                        dtype=dtype, device=device)
    return [(cache[i, 0], cache[i, 1]) for i in range(config.num_layers)]


@dataclass
class BlockPool:
    """Which blocks are free; a sequence's ``block_table`` lists the blocks it holds, in order."""

    num_blocks: int
    block_size: int

    def __post_init__(self):
        self.free_blocks = deque(range(self.num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def grow(self, block_table: list[int], num_tokens: int) -> bool:
        """Extend ``block_table`` to hold ``num_tokens``; all or nothing."""
        extra = self.blocks_for(num_tokens) - len(block_table)
        if extra <= 0:
            return True
        if extra > len(self.free_blocks):
            return False
        block_table.extend(self.free_blocks.popleft() for _ in range(extra))
        return True

    def release(self, block_table: list[int]) -> None:
        self.free_blocks.extend(block_table)
        block_table.clear()
