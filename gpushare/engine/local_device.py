"""LocalDevice: an Engine in this very process as a Device (protocol/device.py), plus loading model
files into it: what the offline tools, the benchmarks' in-process baseline, ``engine.isolation:
thread`` and the registry's tests hand the registry. ``local_devices`` builds one per device of the
worker plan for the daemon.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable

from gpushare.engine.engine import Engine
from gpushare.engine.passing_threads import in_passing_thread
from gpushare.engine.test_hooks import install_test_stall
from gpushare.models.host_copy import to_device, to_host
from gpushare.protocol.device import Device
from gpushare.protocol.engine_config import EngineConfig
from gpushare.protocol.engine_stats import EngineSnapshot, EngineStats
from gpushare.protocol.outputs import RequestOutput
from gpushare.protocol.request import EmbedRequest, GenerationRequest
from gpushare.protocol.tenant_policy import TenantPolicy, TenantStats


def default_loader(path: str, dtype: str, device: str, progress, weights: str = "auto"):
    from gpushare.models.loader import load_model

    return load_model(path, dtype=dtype, device=device, progress=progress, weights=weights)


class LocalDevice(Device):
    """An Engine in this process, plus loading model files into it (blocking the caller; the torch work
    runs in a thread that ends with it, engine/passing_threads.py)."""

    pid = None
    world_size = 1

    def __init__(self, engine, name: str | None = None, loader=default_loader):
        self.engine = engine
        self.name = name or engine.config.device
        self._loader = loader  # (path, dtype, device, progress, weights=...) -> LoadedModel
        self.on_exit = None

    # ---- life: the engine's thread (it never exits on its own, so on_exit is never called) -----
    def start(self) -> None:
        self.engine.start()

    def shutdown(self) -> None:
        self.engine.shutdown()

    # ---- the engine's side: its own ----------------------------------------------------------
    @property
    def snapshot(self) -> EngineSnapshot:
        return self.engine.snapshot

    @property
    def tenant_policies(self) -> dict[str, TenantPolicy]:
        return self.engine.tenant_policies

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def kv_pool_bytes(self) -> int:
        return self.engine.kv_pool.capacity_bytes

    @property
    def failure(self) -> str | None:
        return self.engine.failure

    @property
    def last_tick_s(self) -> float:
        return self.engine.last_tick_s

    def alive(self) -> bool:
        return self.engine.alive()

    def submit(self, request: GenerationRequest, on_output: Callable[[RequestOutput], None]) -> str:
        return self.engine.submit(request, on_output)

    def cancel(self, request_id: str) -> None:
        self.engine.cancel(request_id)

    def embed(self, request: EmbedRequest) -> Future:
        return self.engine.embed(request)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def tenant_stats(self) -> dict[str, TenantStats]:
        return self.engine.tenant_stats()

    def has_work(self, model_name: str | None = None) -> bool:
        return self.engine.has_work(model_name)

    def set_tenants(self, policies: list[TenantPolicy]) -> None:
        self.engine.set_tenants(policies)

    def set_share_weight(self, name: str, share_weight: float) -> None:
        self.engine.set_share_weight(name, share_weight)

    # ---- the residency's side -----------------------------------------------------------------

    def load(self, name: str, path: str, dtype: str, weights: str, share_weight: float, progress, warm,
             warm_key: tuple):
        """(the LoadedModel, its weight bytes, whether it came warm). Blocking."""
        device = self.engine.config.device
        self.engine.fit_kv_pool(floor=True)  # on a GPU, room for the weights (engine/kv_sizing.py)
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

    def attach_adapter(self, name: str, base: str, path: str) -> int:
        """Serve the LoRA adapter at `path` as `name` on loaded model `base`; its weight bytes. Blocking."""
        from gpushare.models.lora import READ_TIMEOUT_S, read_adapter

        try:  # a read that hangs is left behind: loads here run side by side, none waits on it
            adapter = in_passing_thread(read_adapter, path, name).result(timeout=READ_TIMEOUT_S)
        except TimeoutError:
            raise TimeoutError(f"adapter {name!r}: its files took over {READ_TIMEOUT_S:g}s to read") from None
        self.engine.add_adapter(name, base, adapter)
        return adapter.nbytes

    def detach_adapter(self, name: str) -> None:
        self.engine.remove_adapter(name)


def local_devices(configs: dict[str, EngineConfig]) -> dict[str, LocalDevice]:
    """``engine.isolation: thread``: each device's engine on a thread of this process (no isolation)."""
    devices = {}
    for name, config in configs.items():
        engine = Engine(config)
        install_test_stall(engine)
        devices[name] = LocalDevice(engine, name=name)
    return devices
