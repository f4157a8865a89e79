"""The engine workers of this node: started from the worker plan, watched, restarted when they die.

One WorkerClient per WorkerPlan (node/devices.py). A worker that dies (killed, OOM, a CUDA
error, an engine failure) has already failed its own requests (worker_client.py); here its device
is marked unhealthy, the registry forgets the models it held, and the worker is started again
after a back-off (1 s, doubling up to 30 s while it keeps dying within a minute of starting).
Once back, it gets the tenant policies again and the preload/pinned models that belong to it;
other models reload on demand. GPU devices are also checked with NVML every few seconds (ECC
errors, retired pages, Xid events: node/gpu_health.py): an unhealthy GPU gets no new models.
Runs on the daemon's event loop; worker starts block in threads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from gpushare.residency.worker_client import WorkerClient, WorkerDied

log = logging.getLogger("gpushare.workers")

RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
STABLE_AFTER_S = 60.0  # a worker up this long starts its back-off afresh when it dies
HEALTH_CHECK_S = 10.0


@dataclass
class DeviceStatus:
    healthy: bool = True
    reason: str | None = None  # why not healthy
    restarts: int = 0
    started_at: float = 0.0  # time.monotonic() of the latest start


class DeviceSupervisor:
    def __init__(self, clients: dict[str, WorkerClient], gpu_uuids: dict[str, str | None] | None = None,
                 nvml=None):
        self.clients = clients
        self.nvml = nvml  # the NVML module (None: pynvml); tests pass a fake built from real captures
        self.status = {name: DeviceStatus() for name in clients}
        self.gpu_uuids = gpu_uuids or {}  # device -> the GPU (or MIG instance) NVML checks
        self.on_lost = None  # (device name) -> None: the registry forgets its models
        self.on_back = None  # (device name) -> None: tenants again, preloads
        self.closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()
        self._failures_in_a_row: dict[str, int] = {name: 0 for name in clients}

    async def start(self) -> None:
        """Start every worker (in parallel); a worker that cannot start stops the daemon (raises WorkerDied)."""
        self._loop = asyncio.get_running_loop()
        for client in self.clients.values():
            client.on_exit = self._exited
        await asyncio.gather(*(asyncio.to_thread(c.start) for c in self.clients.values()))
        now = time.monotonic()
        for status in self.status.values():
            status.started_at = now
        if any(self.gpu_uuids.values()):
            self._spawn(self._check_health())

    async def close(self) -> None:
        self.closing = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(asyncio.to_thread(c.shutdown) for c in self.clients.values()))

    def healthy(self, name: str) -> bool:
        return self.status[name].healthy

    # ---- a worker died --------------------------------------------------------------------
    def _exited(self, client: WorkerClient, why: str) -> None:  # the client's reader thread
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._lost, client.name, why)

    def _lost(self, name: str, why: str) -> None:
        if self.closing:
            return
        status = self.status[name]
        status.healthy, status.reason = False, why
        if self.on_lost is not None:
            self.on_lost(name)
        if time.monotonic() - status.started_at > STABLE_AFTER_S:
            self._failures_in_a_row[name] = 0
        self._spawn(self._restart(name))

    async def _restart(self, name: str) -> None:
        client = self.clients[name]
        while not self.closing:
            attempt = self._failures_in_a_row[name]
            self._failures_in_a_row[name] += 1
            delay_s = RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)]
            log.warning("restarting the engine worker for %s in %gs", name, delay_s)
            await asyncio.sleep(delay_s)
            try:
                await asyncio.to_thread(client.start)
            except WorkerDied as e:
                self.status[name].reason = str(e)
                continue
            status = self.status[name]
            status.healthy, status.reason = True, None
            status.restarts += 1
            status.started_at = time.monotonic()
            if self.on_back is not None:
                self.on_back(name)
            return

    # ---- NVML health ----------------------------------------------------------------------
    async def _check_health(self) -> None:
        from gpushare.node.gpu_health import XidWatch

        uuids = sorted({uuid for uuid in self.gpu_uuids.values() if uuid})
        xids = await asyncio.to_thread(XidWatch, uuids, self.nvml)
        try:
            while not self.closing:
                await asyncio.sleep(HEALTH_CHECK_S)
                await self.check_health(xids)
        finally:
            xids.close()

    async def check_health(self, xids) -> None:
        """Read each GPU device's health once (node/gpu_health.py); a faulty one is marked unhealthy, so
        placement puts no new model on it. It stays so: faults like these need a GPU reset."""
        from gpushare.node.gpu_health import read_health

        await asyncio.to_thread(xids.poll)
        for name, uuid in self.gpu_uuids.items():
            if not uuid:
                continue
            health = await asyncio.to_thread(read_health, self.nvml, uuid, xids)
            status = self.status[name]
            if not health.healthy and self.clients[name].alive():
                if status.healthy:
                    log.error("device %s is unhealthy: %s", name, "; ".join(health.reasons))
                status.healthy, status.reason = False, "; ".join(health.reasons)

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
