"""The warm tier: unloaded models kept built in host memory, so that loading one again skips
parsing and dequantising its file.

At most memory.host_cache bytes (0 disables it); the least recently unloaded model goes
first. On the CPU a warm model is the very LoadedModel that served (its weights already
live in host RAM): keeping it costs nothing and reloading it is a KV-pool allocation. On
CUDA, `to_host` copies the weights into pinned host memory when the model is unloaded,
freeing the device memory, and `to_device` copies them back (a PCIe copy, no parsing).
The registry calls both from worker threads and touches the cache itself only on its
event loop.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

log = logging.getLogger("gpushare.registry")


def _move_tensors(module: torch.nn.Module, move) -> None:
    """Replace every parameter's and buffer's storage by `move(tensor)`, in place: tied weights
    (one Parameter in two modules) stay tied, and every module keeps its own objects."""
    for p in module.parameters():
        p.data = move(p.data)
    for sub in module.modules():
        for name, buf in list(sub.named_buffers(recurse=False)):
            setattr(sub, name, move(buf))


def to_host(loaded):
    """The LoadedModel with its weights in host memory (pinned, for a fast copy back)."""
    if loaded.device == "cpu":
        return loaded
    _move_tensors(loaded.model, lambda t: t.to("cpu").pin_memory())
    torch.cuda.empty_cache()
    return loaded


def to_device(loaded, device: str):
    """The warm LoadedModel back on `device`, ready for engine.add_model."""
    if device != "cpu":
        _move_tensors(loaded.model, lambda t: t.to(device, non_blocking=True))
        torch.cuda.synchronize(device)
    return loaded


@dataclass
class WarmModel:
    loaded: object  # gpushare.models.loader.LoadedModel, weights in host memory
    weight_bytes: int


class WarmCache:
    """Warm models by key (file digest, dtype, device), least recently stored first."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._models: OrderedDict[tuple, WarmModel] = OrderedDict()

    @property
    def used_bytes(self) -> int:
        return sum(m.weight_bytes for m in self._models.values())

    def __contains__(self, key: tuple) -> bool:
        return key in self._models

    def fits(self, weight_bytes: int) -> bool:
        return 0 < weight_bytes <= self.capacity_bytes

    def put(self, key: tuple, loaded, weight_bytes: int) -> None:
        """Keep `loaded` if it fits at all, pushing out the least recently stored to make room."""
        if not self.fits(weight_bytes):
            return
        self._models.pop(key, None)
        self._models[key] = WarmModel(loaded, weight_bytes)
        self._trim()

    def take(self, key: tuple):
        """The warm LoadedModel for `key`, removed from the cache; None when it is not here."""
        warm = self._models.pop(key, None)
        return warm.loaded if warm is not None else None

    def resize(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._trim()

    def _trim(self) -> None:
        while self._models and self.used_bytes > self.capacity_bytes:
            _, warm = self._models.popitem(last=False)
            log.info("dropped %s from the warm tier (memory.host_cache)", warm.loaded.name_or_path)
