"""The supervisor's handle on a tensor-parallel group: one engine worker per rank, one device to
the registry.

The group is named after its devices in rank order ("cpu:0+cpu:1"). Requests, settings and
snapshots go to the first rank, whose engine schedules for the whole group; loads go to every
rank at once (each builds its part of the model) and the model is in only when all have it;
unloads go to the first rank first, so no step for the model is still to come when the other
ranks drop it. When any rank dies the others are killed and the supervisor restarts the group as
one, with a fresh rendezvous file (engine/tp_runtime.py).
"""

from __future__ import annotations

import os
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from gpushare.catalog.model_head import LoadedModel
from gpushare.protocol.device import Device
from gpushare.protocol.engine_stats import EngineSnapshot, EngineStats
from gpushare.protocol.outputs import RequestOutput
from gpushare.protocol.request import EmbedRequest, GenerationRequest
from gpushare.protocol.tenant_policy import TenantPolicy, TenantStats
from gpushare.residency.worker_client import WorkerClient, WorkerDied


class GroupClient(Device):
    def __init__(self, ranks: list[WorkerClient], on_exit: Callable | None = None):
        self.ranks = ranks
        self.leader = ranks[0]
        self.name = "+".join(r.name for r in ranks)
        self.members = [r.name for r in ranks]  # the devices it runs on, in rank order
        self.world_size = len(ranks)
        self.on_exit = on_exit  # (group, why) once a rank has died and the rest are stopped
        self._exited = threading.Event()
        self._lock = threading.Lock()
        self._stopping = False

    # ---- life -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start every rank (they meet in torch.distributed's rendezvous) and wait until all run."""
        folder = tempfile.mkdtemp(prefix="gpushare-tp-")
        for rank in self.ranks:
            rank.spec.group.init_file = os.path.join(folder, "rendezvous")
            rank.on_exit = self._rank_exited
        self._exited.clear()
        self._stopping = False
        try:
            with ThreadPoolExecutor(len(self.ranks)) as pool:
                for future in [pool.submit(rank.start) for rank in self.ranks]:
                    future.result()
        except WorkerDied:
            self._stopping = True
            self.kill()
            raise
        finally:
            try:
                os.unlink(os.path.join(folder, "rendezvous"))
            except FileNotFoundError:
                pass
            os.rmdir(folder)

    def shutdown(self) -> None:
        """The other ranks first: they wait in the group's next broadcast, the first rank in nothing."""
        self._stopping = True
        for rank in self.ranks[::-1]:
            rank.shutdown()

    def kill(self) -> None:
        for rank in self.ranks:
            rank.kill()

    def _rank_exited(self, rank: WorkerClient, why: str) -> None:  # a rank's reader thread
        with self._lock:
            first = not self._exited.is_set()
            self._exited.set()
        if not first or self._stopping:
            return
        for other in self.ranks:
            if other is not rank:
                other.on_exit = None  # its end is this one's consequence, not another death to handle
                other.kill()
        if self.on_exit is not None:
            self.on_exit(self, f"rank {self.ranks.index(rank)} of tensor-parallel group {self.name}: {why}")

    @property
    def config(self):
        return self.leader.config

    @property
    def kv_pool_bytes(self) -> int:
        return self.leader.kv_pool_bytes

    @property
    def pid(self) -> int | None:
        return self.leader.pid

    @property
    def pids(self) -> list[int]:
        return [r.pid for r in self.ranks if r.pid is not None]

    def alive(self) -> bool:
        return all(r.alive() for r in self.ranks)

    # ---- the first rank's engine, which schedules for the group ------------------------------
    @property
    def snapshot(self) -> EngineSnapshot:
        return self.leader.snapshot

    @property
    def tenant_policies(self) -> dict[str, TenantPolicy]:
        return self.leader.tenant_policies

    @property
    def failure(self) -> str | None:
        return self.leader.failure

    @property
    def last_tick_s(self) -> float:
        return self.leader.last_tick_s

    def submit(self, request: GenerationRequest, on_output: Callable[[RequestOutput], None]) -> str:
        return self.leader.submit(request, on_output)

    def cancel(self, request_id: str) -> None:
        self.leader.cancel(request_id)

    def embed(self, request: EmbedRequest) -> Future:
        return self.leader.embed(request)

    def stats(self) -> EngineStats:
        return self.leader.stats()

    def tenant_stats(self) -> dict[str, TenantStats]:
        return self.leader.tenant_stats()

    def has_work(self, model_name: str | None = None) -> bool:
        return self.leader.has_work(model_name)

    def set_tenants(self, policies: list[TenantPolicy]) -> None:
        self.leader.set_tenants(policies)

    def set_share_weight(self, name: str, share_weight: float) -> None:
        self.leader.set_share_weight(name, share_weight)

    # ---- models ---------------------------------------------------------------------------
    def load(self, name: str, path: str, dtype: str, weights: str, share_weight: float, progress, warm,
             warm_key: tuple) -> tuple[LoadedModel, int, bool]:
        """Every rank builds its part (blocking); returns the first rank's text side, the weight bytes
        of all ranks together and whether it came warm. A rank that fails unloads the others."""
        with ThreadPoolExecutor(len(self.ranks)) as pool:
            futures = [pool.submit(self.leader.load, name, path, dtype, weights, share_weight, progress, warm,
                                   warm_key)]
            futures += [pool.submit(rank.build, name, path, dtype, weights, share_weight, None,
                                    warm_key if warm else None) for rank in self.ranks[1:]]
            results, errors = [], []
            for future in futures:
                try:
                    results.append(future.result())
                except Exception as e:
                    results.append(None)
                    errors.append(e)
        if errors:
            for rank, result in zip(self.ranks, results):
                if result is not None:
                    try:
                        rank.unload(name, None, None)
                    except WorkerDied:
                        pass
            raise errors[0]
        (head, leader_bytes, leader_warm), others = results[0], results[1:]
        return head, leader_bytes + sum(r.weight_bytes for r in others), leader_warm and all(r.warm for r in others)

    def unload(self, name: str, model: LoadedModel, warm_key: tuple | None) -> LoadedModel | None:
        kept = self.leader.unload(name, model, warm_key)
        for rank in self.ranks[1:]:
            rank.unload(name, model, warm_key)
        return kept

    def drop_warm(self, warm_key: tuple) -> None:
        for rank in self.ranks:
            rank.drop_warm(warm_key)

    def attach_adapter(self, name: str, base: str, path: str) -> int:
        """The first rank refuses it (a ValueError): adapters are not split over ranks."""
        return self.leader.attach_adapter(name, base, path)

    def detach_adapter(self, name: str) -> None:
        self.leader.detach_adapter(name)
