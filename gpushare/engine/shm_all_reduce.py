"""All-reduce between the CPU ranks of one tensor-parallel group through shared memory.

gloo moves every message through its own I/O threads and the loopback TCP stack: on a 2-core
machine one all-reduce of a decode step's [1, 576] block output takes 0.5-1.2 ms (its own
algorithm, or an exchange of the parts), and a step runs two per layer. Here each rank copies its
part into its slot of a shared segment, raises its flag to the call's sequence number, waits until
every flag has, and adds the slots in rank order: every rank gets the same bits, in microseconds
when the ranks arrive together (benchmarks/tensor_parallel.py).

Slots come in two sets used alternately: a rank writes round s only after finishing round s - 1,
which every rank had entered, so all have finished reading round s - 2 from the set it reuses.
A part larger than a slot goes through in slot-sized pieces. A rank spins on the flags for a
while (~1.5 ms), then yields its core between looks to the process's other threads. The flags
are read and written in program order, which x86's memory model (TSO) keeps for other cores:
elsewhere the group uses gloo. A rank that dies leaves the others waiting; the supervisor then
stops the whole group. The logits' vocabulary slices are gathered through the same slots.
"""

from __future__ import annotations

import mmap
import os
import platform

import numpy as np
import torch

SLOT_BYTES = 4 << 20  # per rank and set: a 2,048-token prefill chunk of a 512-wide model in one piece
SPIN_CHECKS = 1_000  # flag reads (~1.5 us each) before yielding the core between reads


def supported() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")


class ShmAllReduce:
    """One rank's handle; the first rank creates the segment file (in /dev/shm: memory, not disk),
    the others open it, and once all have it mapped ``unlink`` removes its name."""

    def __init__(self, path: str, rank: int, world_size: int):
        self.rank, self.world_size, self.path = rank, world_size, path
        flags_bytes = 64 * world_size  # a cache line per rank's flag
        size = flags_bytes + 2 * world_size * SLOT_BYTES
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if rank == 0 else 0), 0o600)
        try:
            if rank == 0:
                os.ftruncate(fd, size)
            self._mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.flags = np.frombuffer(self._mapping, dtype=np.int64, count=8 * world_size)[::8]
        self.slots = torch.frombuffer(self._mapping, dtype=torch.uint8, offset=flags_bytes,  # host: shared memory
                                      count=2 * world_size * SLOT_BYTES).view(2, world_size, SLOT_BYTES)
        self.sequence = 0

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_contiguous():
            return x.copy_(self(x.contiguous()))
        flat = x.view(-1).view(torch.uint8)
        step = SLOT_BYTES // x.element_size() * x.element_size()
        for start in range(0, flat.numel(), step):
            self._round(flat[start:start + step], x.dtype)
        return x

    def gather_columns(self, part: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """Every rank's ``[rows, widths[rank]]`` float32 part, side by side in rank order, on the first
        rank (None on the others); in row slices that fit a slot."""
        rows = part.shape[0]
        per_round = max(1, SLOT_BYTES // (4 * max(widths)))
        out = torch.empty(rows, sum(widths)) if self.rank == 0 else None  # host: CPU ranks only
        for first in range(0, rows, per_round):
            chunk = part[first:first + per_round].contiguous()
            slots = self._publish(chunk.view(-1).view(torch.uint8))
            if self.rank == 0:
                n, column = chunk.shape[0], 0
                for r, width in enumerate(widths):
                    out[first:first + n, column:column + width] = slots[r, :n * width * 4].view(torch.float32).view(
                        n, width)
                    column += width
        return out

    def _publish(self, piece: torch.Tensor) -> torch.Tensor:
        """Put ``piece`` (bytes) in this rank's slot of the next round and wait for every rank's;
        returns that round's slots."""
        self.sequence += 1
        slots = self.slots[self.sequence % 2]
        slots[self.rank, :piece.numel()].copy_(piece)
        self.flags[self.rank] = self.sequence
        checks = 0
        while (self.flags < self.sequence).any():
            checks += 1
            if checks > SPIN_CHECKS:  # let this core's other threads (HTTP, outputs) run
                os.sched_yield()
        return slots

    def _round(self, piece: torch.Tensor, dtype: torch.dtype) -> None:
        n = piece.numel()
        slots = self._publish(piece)
        total = slots[0, :n].view(dtype).clone()
        for r in range(1, self.world_size):
            total += slots[r, :n].view(dtype)
        piece.copy_(total.view(torch.uint8))
