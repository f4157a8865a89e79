"""A step's pause signal: whether other threads handed the engine new work since it last looked.

``run_layers`` may pause a step between two layers when asked. A plain callable is asked between
two layer calls; this signal is also a one-byte flag that a C++ call running many layers reads
after each of them (kernels/cpu_decode.cpp), so a step can run whole in one call and still pause
after any layer. Whoever hands work over sets it after the hand-over; the engine clears it before
it looks, so new work is never missed (at worst a step pauses once for nothing).
"""

import torch


class PauseSignal:
    def __init__(self):
        self.flag = torch.zeros(1, dtype=torch.uint8)  # host: a store the C++ layers read
        self._byte = self.flag.numpy()  # the same memory: a store, not a torch op

    def set(self) -> None:
        self._byte[0] = 1

    def clear(self) -> None:
        self._byte[0] = 0

    def __call__(self) -> bool:
        return bool(self._byte[0])
