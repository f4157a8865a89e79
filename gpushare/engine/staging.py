"""A step's host lists (token ids, positions, slots, block tables, sampling parameters) made into
tensors on the step's device.

On a GPU every list of one upload is written into one pinned, preallocated host buffer and goes
over in one ``non_blocking`` copy, each tensor a view of the bytes that arrived: no pageable copy,
none of the stream synchronisations that ``torch.tensor(list, device="cuda")`` makes each time.
The host buffer is written again only once its last copy has completed (an event; a step paused
between layers may still have its copy queued when an urgent step uploads its own). The device
side is a fresh allocation per upload (the caching allocator's, stream-ordered), so the tensors of
a paused step are never overwritten.

On the CPU the lists become tensors as they are (``torch.tensor``): nothing to copy, nothing to stage.
"""

import torch

ALIGN_BYTES = 8  # every view starts aligned for the widest dtype uploaded (int64, float64)


def _aligned(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


class Staging:
    def __init__(self, device):
        self.device = torch.device(device)
        self._host: torch.Tensor | None = None  # pinned uint8, grown by doubling
        self._copied = None  # torch.cuda.Event of the last copy out of _host

    def upload(self, *parts: tuple[list, torch.dtype]) -> list[torch.Tensor]:
        """One tensor per ``(values, dtype)`` (nested lists give their shape) on this device; on a
        GPU all in a single copy."""
        if self.device.type != "cuda":
            return [torch.tensor(values, dtype=dtype, device=self.device) for values, dtype in parts]
        tensors = [torch.tensor(values, dtype=dtype) for values, dtype in parts]  # host: written into the pinned buffer
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += _aligned(t.numel() * t.element_size())
        total = max(total, ALIGN_BYTES)
        if self._copied is not None:
            self._copied.synchronize()  # at once unless a paused step's copy is still queued
        if self._host is None or self._host.numel() < total:
            size = max(total, 2 * (self._host.numel() if self._host is not None else 1 << 16))
            self._host = torch.empty(size, dtype=torch.uint8, pin_memory=True)  # host: the pinned staging buffer
        for t, offset in zip(tensors, offsets):
            self._host[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t)
        arrived = torch.empty(total, dtype=torch.uint8, device=self.device)
        arrived.copy_(self._host[:total], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return [arrived[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                for t, offset in zip(tensors, offsets)]
