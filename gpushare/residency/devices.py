"""Devices as the registry and the API see them: an engine they submit to and load models into.

A device is either an engine worker process (residency/worker_client.py: what the daemon runs,
one per GPU, MIG instance or CPU set) or ``LocalDevice``: an Engine in this very process, which
the offline tools, the benchmarks' in-process baseline and the registry's tests use. Both have the
same surface: the engine's (submit, cancel, embed, stats, tenant_stats, has_work, set_tenants,
tenant_policies, set_share_weight, snapshot, alive, failure, last_tick_s) and the residency's
(name, kv_pool_bytes, load, unload, drop_warm, pid).
"""

from __future__ import annotations

from gpushare.engine.passing_threads import in_passing_thread
from gpushare.models.host_copy import to_device, to_host


def default_loader(path: str, dtype: str, device: str, progress, weights: str = "auto"):
    from gpushare.models.loader import load_model

    return load_model(path, dtype=dtype, device=device, progress=progress, weights=weights)


class LocalDevice:
    """An Engine in this process, plus loading model files into it (blocking the caller; the torch work
    runs in a thread that ends with it, engine/passing_threads.py)."""

    pid = None
    world_size = 1

    def __init__(self, engine, name: str | None = None, loader=default_loader):
        self.engine = engine
        self.name = name or engine.config.device
        self._loader = loader  # (path, dtype, device, progress, weights=...) -> LoadedModel

    def __getattr__(self, attr):  # the engine's surface: submit, cancel, embed, stats, ...
        return getattr(self.engine, attr)

    @property
    def kv_pool_bytes(self) -> int:
        return self.engine.kv_pool.capacity_bytes

    def load(self, name: str, path: str, dtype: str, weights: str, share_weight: float, progress, warm,
             warm_key: tuple):
        """(the LoadedModel, its weight bytes, whether it came warm). Blocking."""
        device = self.engine.config.device
        if warm is not None:
            model = in_passing_thread(to_device, warm, device).result()
        else:
            model = in_passing_thread(lambda: self._loader(path, dtype, device, progress, weights=weights)).result()
        self.engine.add_model(name, model, share_weight=share_weight)
        return model, model.weight_bytes, warm is not None

    def unload(self, name: str, model, warm_key: tuple | None):
        """What the warm tier keeps of the model (it, in host memory), or None. Blocking."""
        self.engine.remove_model(name)
        return in_passing_thread(to_host, model).result() if warm_key is not None else None

    def drop_warm(self, warm_key: tuple) -> None:
        """The warm tier holds the model itself: letting go of it is all there is to do."""
