"""The device KV pool: one buffer per engine that every loaded model's paged KV cache lives in.

The buffer is cut into slabs. A model takes a slab when its sequences need blocks and gives it
back once no block in it is held or cached, so an idle model holds no KV memory and a busy one
can use the whole pool. Each model sees the buffer as one array of its own blocks
(``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``, all layers of a block
together) and may use the blocks that lie wholly inside its slabs. The slab size is a whole
number of blocks of the first model loaded into an empty pool; a model with another block size
loses at most one block a slab where a block straddles two slabs.

On the CPU the buffer is an anonymous mapping: pages are committed when first written, and a
slab given back is returned to the kernel (madvise DONTNEED), so resident memory follows use.
On a GPU the buffer is allocated at once (CUDA virtual memory management is not used); it
changes size by being allocated anew while no slab is handed out (`resize`; engine/kv_sizing.py
says when).
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from typing import Callable

import torch

from gpushare import kernels
from gpushare.protocol.engine_config import kv_dtype_name
from gpushare.kernels.paged_attention_torch import Int8KV
from gpushare.catalog.model_config import ModelConfig

INT8_SCALE_BYTES = 4  # int8 KV: a float32 scale per token and KV head


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    if dtype == torch.int8:
        per_token = 2 * config.num_layers * config.num_kv_heads * (config.head_dim + INT8_SCALE_BYTES)
        return per_token * block_size
    return config.kv_bytes_per_token(torch.empty((), dtype=dtype, device="meta").element_size()) * block_size


def resolve_kv_dtype(kv_dtype: str, device: str, weights: str = "auto") -> torch.dtype:
    """The torch dtype of the ``engine.kv_dtype`` setting on ``device`` with the engine's default
    ``weights`` (engine_config.kv_dtype_name says which, and why). ``auto`` keeps float32 on a CPU
    whose C++ attention does not run: the torch path rounds a prompt's rows differently from decode
    rows, and bfloat16 would turn that into answers that depend on the prefix cache."""
    name = kv_dtype_name(kv_dtype, device, weights)
    if kv_dtype == "auto" and not device.startswith("cuda") and not kernels.cpu_kernels_run():
        name = "float32"
    return getattr(torch, name)


def _allocate(capacity_bytes: int, device: str):
    """The pool's bytes (uint8 tensor) and, on the CPU, the mapping behind them."""
    if device.startswith("cuda"):
        return torch.empty(capacity_bytes, dtype=torch.uint8, device=device), None
    mapping = mmap.mmap(-1, capacity_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=torch.uint8), mapping  # host: the CPU pool is this mapping


@dataclass
class DeviceKVPool:
    capacity_bytes: int
    device: str = "cpu"
    slab_blocks: int = 8  # blocks of the first model per slab
    slab_bytes: int = 0  # set when the first model registers into an empty pool
    slab_unit_bytes: int = 0  # the first model's slab_blocks blocks: slab_bytes unless the pool is smaller
    owners: list = field(default_factory=list)  # slab -> the BlockPool holding it, or None
    free_slabs: list[int] = field(default_factory=list)
    members: list = field(default_factory=list)  # registered BlockPools
    # Called with each byte range given back (tensor parallel: the other ranks decommit theirs too).
    on_decommit: Callable[[int, int], None] | None = None

    def __post_init__(self):
        if self.capacity_bytes <= 0:
            raise ValueError(f"KV pool size must be more than zero, got {self.capacity_bytes}")
        self.buffer, self._mapping = _allocate(self.capacity_bytes, self.device)

    @property
    def num_slabs(self) -> int:
        return len(self.owners)

    @property
    def committed_bytes(self) -> int:
        """Bytes of the slabs handed out (on the CPU an upper bound: pages commit when written)."""
        return sum(self.slab_size(s) for s, owner in enumerate(self.owners) if owner is not None)

    def slab_size(self, slab: int) -> int:
        return min(self.slab_bytes, self.capacity_bytes - slab * self.slab_bytes)

    def register(self, member, block_bytes: int) -> None:
        if block_bytes > self.capacity_bytes:
            raise ValueError(f"the KV pool ({self.capacity_bytes} bytes) is smaller than one block of "
                             f"this model ({block_bytes} bytes); raise memory.kv_budget")
        if not self.members:
            self.slab_unit_bytes = block_bytes * self.slab_blocks
            self._cut_slabs()
        self.members.append(member)

    def _cut_slabs(self) -> None:
        self.slab_bytes = min(self.capacity_bytes, self.slab_unit_bytes)
        count = -(-self.capacity_bytes // self.slab_bytes)
        self.owners = [None] * count
        self.free_slabs = list(range(count - 1, -1, -1))  # pop() hands out low slabs first

    def resize(self, capacity_bytes: int) -> None:
        """Allocate the pool anew at ``capacity_bytes``, its contents lost: only while no slab is handed
        out, and once every view into the old buffer (layer_views) is let go. The old bytes are freed
        before the new are allocated: a GPU has no room for both. Members count their blocks again
        (BlockPool.resized); a model's block larger than the new pool is refused as at register."""
        if any(owner is not None for owner in self.owners):
            raise RuntimeError("the KV pool is resized only while no model holds a slab of it")
        if capacity_bytes <= 0 or any(capacity_bytes < m.block_bytes for m in self.members):
            raise ValueError(f"KV pool size {capacity_bytes} is under one block of a loaded model")
        self.buffer = self._mapping = None
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()  # the old buffer's block back to the driver for the new one
        self.capacity_bytes = capacity_bytes
        self.buffer, self._mapping = _allocate(capacity_bytes, self.device)
        if self.members:
            self._cut_slabs()
        for member in self.members:
            member.resized()

    def unregister(self, member) -> None:
        for slab, owner in enumerate(self.owners):
            if owner is member:
                self.give_back(slab)
        self.members.remove(member)

    def blocks_in(self, slab: int, block_bytes: int) -> range:
        """Block ids (of a model with ``block_bytes``) that lie wholly inside ``slab``."""
        start = slab * self.slab_bytes
        end = start + self.slab_size(slab)
        return range(-(-start // block_bytes), end // block_bytes)

    def layer_views(self, config: ModelConfig, block_size: int, dtype: torch.dtype,
                    block_stride_bytes: int | None = None) -> list:
        """Per layer a (K, V) pair of ``[num_blocks, block_size, num_kv_heads, head_dim]`` views into the
        buffer, blocks ``block_bytes`` apart (every layer of a block is stored together).
        ``block_stride_bytes`` (tensor parallel: the first rank's block size, which is the largest)
        places them further apart, so that a block id is at the same place on every rank."""
        block_bytes = kv_bytes_per_block(config, block_size, dtype)
        stride = block_stride_bytes or block_bytes
        num_blocks = self.capacity_bytes // stride
        rows = self.buffer[:num_blocks * stride].view(num_blocks, stride)[:, :block_bytes]
        shape = (num_blocks, config.num_layers, 2, block_size, config.num_kv_heads, config.head_dim)
        if dtype == torch.int8:  # per block: every layer's int8 values, then their float32 scales
            data_bytes = block_bytes // (config.head_dim + INT8_SCALE_BYTES) * config.head_dim
            data = rows[:, :data_bytes].view(torch.int8).view(shape)
            scales = rows[:, data_bytes:].view(torch.float32).view(shape[:-1])
            return [(Int8KV(data[:, i, 0], scales[:, i, 0]), Int8KV(data[:, i, 1], scales[:, i, 1]))
                    for i in range(config.num_layers)]
        blocks = rows.view(dtype).view(shape)
        return [(blocks[:, i, 0], blocks[:, i, 1]) for i in range(config.num_layers)]

    def free_blocks_for(self, block_bytes: int) -> int:
        return sum(len(self.blocks_in(s, block_bytes)) for s in self.free_slabs)

    def take(self, member, shed_others: bool = True) -> int | None:
        """A free slab for ``member``; else (``shed_others``) one that another model holds only
        cached blocks in (it drops them); None when there is none."""
        if not self.free_slabs and shed_others:
            for other in self.members:
                if other is not member and other.shed_one_slab():
                    break
        if not self.free_slabs:
            return None
        slab = self.free_slabs.pop()
        self.owners[slab] = member
        return slab

    def give_back(self, slab: int) -> None:
        self.owners[slab] = None
        self.free_slabs.append(slab)
        start = slab * self.slab_bytes
        self.decommit(start, start + self.slab_size(slab))
        if self.on_decommit is not None:
            self.on_decommit(start, start + self.slab_size(slab))

    def decommit(self, start: int, end: int) -> None:
        """Return the whole pages of bytes [start, end) to the kernel (CPU only): the next write finds
        zeroed, uncommitted pages."""
        if self._mapping is None:
            return
        first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        last = end // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first:
            self._mapping.madvise(mmap.MADV_DONTNEED, first, last - first)


def copy_block(kv_caches: list, source: int, destination: int) -> None:
    """Copy one KV block in every layer of a model's ``layer_views`` (a fork's own copy of a shared
    partial block)."""
    for layer in kv_caches:
        for cache in layer:
            for tensor in (cache.data, cache.scale) if isinstance(cache, Int8KV) else (cache,):
                tensor[destination].copy_(tensor[source])
