"""A step's host lists (token ids, positions, slots, block tables, sampling parameters) made into
tensors on the step's device.

On a GPU every list of one upload is written into one pinned, preallocated host buffer and goes
over in one ``non_blocking`` copy, each tensor a view of the bytes that arrived: no pageable copy,
none of the stream synchronisations that ``torch.tensor(list, device="cuda")`` makes each time.
Uploads take the buffers of a ring in turn, and a buffer is written again only once its last copy
has completed (an event): a step makes a few uploads and reads the device back at its end, so by
the time the ring comes round the copy is long done and nothing waits, while a copy still queued
behind a forward pass (the step's own earlier upload, or a paused step's) is never overwritten.
The device side is a fresh allocation per upload (the caching allocator's, stream-ordered), so the
tensors of a paused step stay as they were.

On the CPU the lists become tensors as they are (``torch.tensor``): nothing to copy, nothing to stage.
"""

import torch

ALIGN_BYTES = 8  # every view starts aligned for the widest dtype uploaded (int64, float64)
RING_BUFFERS = 16  # uploads before a buffer is reused: a step makes under ten
FIRST_BUFFER_BYTES = 64 << 10


def _aligned(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


class Staging:
    def __init__(self, device):
        self.device = torch.device(device)
        self._ring: list = [(None, None)] * RING_BUFFERS  # (pinned uint8 buffer, event of its last copy)
        self._turn = 0

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
        turn, self._turn = self._turn, (self._turn + 1) % RING_BUFFERS
        host, copied = self._ring[turn]
        if copied is not None:
            copied.synchronize()  # an upload RING_BUFFERS ago: done since its step read the device back
        if host is None or host.numel() < total:
            size = max(total, 2 * host.numel() if host is not None else FIRST_BUFFER_BYTES)
            host = torch.empty(size, dtype=torch.uint8, pin_memory=True)  # host: a pinned staging buffer
        for t, offset in zip(tensors, offsets):
            host[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t)
        arrived = torch.empty(total, dtype=torch.uint8, device=self.device)
        arrived.copy_(host[:total], non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(self.device))
        self._ring[turn] = (host, copied)
        return [arrived[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                for t, offset in zip(tensors, offsets)]
