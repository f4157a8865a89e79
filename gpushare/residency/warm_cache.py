"""The warm tier: unloaded models kept built in host memory, so that loading one again skips
parsing and dequantising its file.

At most memory.host_cache bytes (0 disables it); the least recently unloaded model goes
first. What a warm entry holds is what its device's `unload` gave back (protocol/device.py): in
process, the LoadedModel itself with its weights in host memory (models/host_copy.py); for a
worker process, the model's text side, the weights staying in the worker, which drops them
when this cache lets the entry go (`on_drop`). Touched only on the registry's event loop.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

log = logging.getLogger("gpushare.registry")


@dataclass
class WarmModel:
    loaded: object  # gpushare.models.loader.LoadedModel, weights in host memory
    weight_bytes: int


class WarmCache:
    """Warm models by key (file digest, dtype, device), least recently stored first."""

    def __init__(self, capacity_bytes: int, on_drop=None):
        self.capacity_bytes = capacity_bytes
        self._models: OrderedDict[tuple, WarmModel] = OrderedDict()
        self.on_drop = on_drop  # (key) -> None: an entry left without being taken

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
            key, warm = self._models.popitem(last=False)
            log.info("dropped %s from the warm tier (memory.host_cache)", warm.loaded.name_or_path)
            if self.on_drop is not None:
                self.on_drop(key)

    def drop_device(self, device: str) -> None:
        """Forget the entries of `device` (the last item of their keys): its worker process died with them."""
        for key in [k for k in self._models if k[-1] == device]:
            del self._models[key]
