"""Device: what the supervisor (residency, api) holds of a device that runs an engine.

Three classes implement it, each by subclassing it: an engine worker process
(residency/worker_client.WorkerClient: what the daemon runs, one per GPU, MIG instance or CPU set),
a tensor-parallel group of them (residency/group_client.GroupClient, which its first rank speaks
for), and an engine in this very process (engine/local_device.LocalDevice: the offline tools, the
benchmarks' in-process baseline, ``engine.isolation: thread`` and the registry's tests).

The engine's side (submit ... last_tick_s) answers from the latest EngineSnapshot and never blocks;
the residency's side (load, unload, drop_warm, attach_adapter, detach_adapter) blocks, so the
registry calls it off the event loop.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable, Protocol

from gpushare.protocol.engine_config import EngineConfig
from gpushare.protocol.engine_stats import EngineSnapshot, EngineStats
from gpushare.protocol.outputs import RequestOutput
from gpushare.protocol.request import EmbedRequest, GenerationRequest
from gpushare.protocol.tenant_policy import TenantPolicy, TenantStats


class Device(Protocol):
    # Data, as attributes or properties (each implementation picks):
    name: str  # as engine.devices names it ("cpu:0", "cuda:1", "MIG-...", "cpu:0+cpu:1" for a group)
    pid: int | None  # the worker process's (its first rank's for a group); None in this process
    world_size: int  # engine workers behind it: 1, or a tensor-parallel group's ranks
    config: EngineConfig  # its engine's (device, cpus, limits)
    kv_pool_bytes: int  # the device's KV pool
    snapshot: EngineSnapshot  # the engine's state after its latest loop turn
    tenant_policies: dict[str, TenantPolicy]  # what request limits are checked against
    failure: str | None  # why the engine stopped for good, once it has (a worker never does: it restarts)
    last_tick_s: float  # time.monotonic() of the engine loop's latest turn

    on_exit: Callable | None  # (device, why), set by its supervisor: called once its worker is gone

    # ---- life (residency/device_supervisor.py starts, restarts and stops devices; blocking) ------
    def start(self) -> None: ...

    def shutdown(self) -> None: ...

    def alive(self) -> bool: ...

    # ---- the engine's side ------------------------------------------------------------------
    def submit(self, request: GenerationRequest, on_output: Callable[[RequestOutput], None]) -> str:
        """Queue a checked request; ``on_output`` gets its outputs (not on the event loop). KeyError if
        its model is not loaded here."""

    def cancel(self, request_id: str) -> None: ...

    def embed(self, request: EmbedRequest) -> Future:
        """A future of one vector per input."""

    def stats(self) -> EngineStats: ...

    def tenant_stats(self) -> dict[str, TenantStats]: ...

    def has_work(self, model_name: str | None = None) -> bool: ...

    def set_tenants(self, policies: list[TenantPolicy]) -> None: ...

    def set_share_weight(self, name: str, share_weight: float) -> None: ...

    # ---- the residency's side (blocking) ----------------------------------------------------
    def load(self, name: str, path: str, dtype: str, weights: str, share_weight: float, progress, warm,
             warm_key: tuple) -> tuple[object, int, bool]:
        """(the model as this process holds it: a catalog/model_head.LoadedModel, its weight bytes,
        whether it came from the warm tier)."""

    def unload(self, name: str, model, warm_key: tuple | None):
        """What the supervisor's warm tier keeps of the model under ``warm_key``, or None."""

    def drop_warm(self, warm_key: tuple) -> None: ...

    def attach_adapter(self, name: str, base: str, path: str) -> int:
        """Serve the LoRA adapter at `path` (a PEFT folder or a GGUF LoRA) as model `name` on loaded model
        `base`; returns its weight bytes. ValueError naming what is wrong when it does not fit."""

    def detach_adapter(self, name: str) -> None: ...
