"""How much of the engine's device memory is used and free: CUDA's own count on a GPU
(torch.cuda.mem_get_info, which counts every process on the card), the host's RAM on the CPU.
Read into each snapshot (/api/ps, `gpushare ps`) and, on a GPU, to size the KV pool."""

from dataclasses import dataclass

import torch


@dataclass
class DeviceMemory:
    kind: str  # "cuda": the engine's GPU; "host": the RAM a CPU engine (and everything else here) uses
    used_bytes: int
    free_bytes: int


def device_memory(device: str) -> DeviceMemory:
    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info(torch.device(device))
        return DeviceMemory("cuda", total - free, free)
    import psutil

    ram = psutil.virtual_memory()
    return DeviceMemory("host", ram.total - ram.available, ram.available)
