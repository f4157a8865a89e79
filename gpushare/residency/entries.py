"""What the residency keeps of each model: a loaded copy's entry (LoadedEntry: its device, size,
leases, keep_alive), a model on its way in (LoadJob), and the errors a load answers with."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from gpushare.catalog.model_catalog import ModelSource
from gpushare.protocol.device import Device


class RegistryFull(RuntimeError):
    """No room now: too many requests queued for a model, or memory held by busy models too long."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelLoadError(RuntimeError):
    """A model that cannot load. ``refused``: its files were refused as data (malformed, over a cap,
    a link out of its folder, not a regular file), a 422 naming why; else a failure of the node (500)."""

    def __init__(self, message: str, refused: bool = False):
        super().__init__(message)
        self.refused = refused


@dataclass
class LoadedEntry:
    source: ModelSource
    model: object  # gpushare.models.loader.LoadedModel
    weight_bytes: int
    load_duration_s: float
    warm_load: bool  # taken from the warm tier rather than parsed from its file
    warm_key: tuple  # (file digest, dtype, weights, device): its place in the warm tier once unloaded
    parameter_count: int
    keep_alive_s: float = 0.0
    active: int = 0  # leases held: requests running, queued in the engine, or about to submit
    outstanding_tokens: int = 0  # prompt plus max_tokens of the requests holding those leases
    last_used: float = field(default_factory=time.monotonic)
    expires_at: float | None = None  # wall-clock epoch seconds; None: never (or busy, keep_alive < 0)
    timer: asyncio.TimerHandle | None = None
    retired: bool = False  # its config entry is gone: takes no new request, unloads once idle
    device: Device | None = None  # the device it is loaded on: what requests submit to
    base: LoadedEntry | None = None  # a LoRA adapter's: the base it is attached to, which it holds a lease on

    @property
    def engine_name(self) -> str:
        """The engine's model its requests run on (whose stats the snapshot has): its own, or its base's."""
        return self.base.name if self.base is not None else self.name

    @property
    def device_name(self) -> str:
        return self.device.name

    @property
    def key(self) -> str:
        """This copy of the model: its name on its device."""
        return f"{self.name}@{self.device_name}"

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def size_bytes(self) -> int:
        """What it holds of memory.budget: its weights (its KV lives in the engine's shared pool); of a
        tensor-parallel model, what one rank holds (the budget is per device)."""
        return -(-self.weight_bytes // self.device.world_size)


@dataclass
class LoadJob:
    """One model on its way in; every request for it waits on `task`."""
    source: ModelSource
    state: str = "queued"  # "queued" (sizing it, waiting for memory) | "loading"
    reserved_bytes: int = 0  # weights, counted against memory.budget once room is found
    done_bytes: int = 0
    total_bytes: int = 0
    waiters: int = 0  # requests waiting; they hold a lease the moment it loads
    task: asyncio.Task | None = None
    device: str | None = None  # where it loads (placement), once chosen
    replica: bool = False  # a further copy, loaded in the background (no request waits for it)
    base: LoadedEntry | None = None  # a LoRA adapter's: the loaded base it attaches to

    @property
    def progress(self) -> float:
        """Fraction of the file read and dequantised (0 until the loader reports)."""
        return self.done_bytes / self.total_bytes if self.total_bytes else 0.0

    def report(self, done_bytes: int, total_bytes: int) -> None:  # loader thread
        self.done_bytes, self.total_bytes = done_bytes, total_bytes
