"""A tensor-parallel group's runtime: the ranks' process group, the first rank's model that tells
the others what to run, and the loop the other ranks run.

Every rank is an engine worker process (engine/worker.py) on its own device. The supervisor loads
and unloads a model on every rank (each builds its part: models/tensor_parallel.py); the first
rank alone runs an Engine (scheduler, paged KV bookkeeping, sampling). Each forward pass it runs,
it first broadcasts (``Forward``: the model's name, token ids, positions and attention layout),
then every rank runs the same layers, meeting in the all-reduce after each attention and MLP
block. The other ranks keep their KV heads at the same block ids, so one block table serves all.
Communication is torch.distributed: gloo between CPU ranks, NCCL between GPUs.

A step's layers run without pausing: the ranks would need a message per layer to agree on where
a pause falls. Collectives are issued from one thread on each rank (the engine thread on the
first, the loop thread on the others), as process groups need.
"""

from __future__ import annotations

import datetime
import logging
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from gpushare.engine.kv_pool import copy_block
from gpushare.models.llama import AttentionBatch

log = logging.getLogger("gpushare.tensor_parallel")

# Ranks wait for their next op without a deadline: a quiet daemon sends none for days.
IDLE_TIMEOUT = datetime.timedelta(days=3650)


@dataclass
class GroupSpec:
    """One rank's place in its group (a WorkerSpec field)."""

    rank: int
    world_size: int
    init_file: str  # torch.distributed's file rendezvous, fresh for each start of the group
    devices: list[str]  # the group's devices in rank order, for logs and ps


@dataclass
class Forward:
    model: str
    input_ids: torch.Tensor
    positions: torch.Tensor
    batch: AttentionBatch


@dataclass
class CopyBlock:
    model: str
    source: int
    destination: int


@dataclass
class Decommit:
    start: int
    end: int


def join_group(spec: GroupSpec, device: str) -> None:
    """Join the group's process group; blocks until every rank has."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"file://{spec.init_file}", rank=spec.rank,
                            world_size=spec.world_size, timeout=IDLE_TIMEOUT)
    log.info("rank %d of %d joined its group (%s) over %s", spec.rank, spec.world_size,
             ", ".join(spec.devices), backend)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def use_all_reduce(model: nn.Module) -> None:
    """Sum every decoder block's partial output over the group."""
    for layer in model.layers:
        layer.reduce = all_reduce


def _broadcast(op) -> object:
    box = [op]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class LeaderModel(nn.Module):
    """The first rank's part of a model, with its model's surface (start, run_layers, finish,
    logits, forward): each forward pass is broadcast to the other ranks before it runs here."""

    def __init__(self, name: str, inner: nn.Module):
        super().__init__()
        self.name = name
        self.inner = inner
        self.config = inner.config
        self.layers = inner.layers

    def start(self, input_ids, positions, batch: AttentionBatch):
        _broadcast(Forward(self.name, input_ids, positions, batch))
        return self.inner.start(input_ids, positions, batch)

    def run_layers(self, state, kv_caches, should_pause=None) -> bool:
        return self.inner.run_layers(state, kv_caches)

    def finish(self, state):
        return self.inner.finish(state)

    def logits(self, hidden):
        return self.inner.logits(hidden)

    def forward(self, input_ids, positions, kv_caches, batch: AttentionBatch):
        state = self.start(input_ids, positions, batch)
        self.run_layers(state, kv_caches)
        return self.finish(state)

    def mirror_copy_block(self, source: int, destination: int) -> None:
        _broadcast(CopyBlock(self.name, source, destination))


def broadcast_decommit(start: int, end: int) -> None:
    """The first rank's KV pool gave bytes back: so do the others (engine thread)."""
    _broadcast(Decommit(start, end))


@dataclass
class FollowerModel:
    model: nn.Module
    kv_caches: list


class Follower:
    """Another rank: runs what the first rank broadcasts, on its own part of each model."""

    def __init__(self, kv_pool):
        self.kv_pool = kv_pool
        self.models: dict[str, FollowerModel] = {}
        self._loaded = threading.Condition()

    def add(self, name: str, entry: FollowerModel) -> None:
        with self._loaded:
            self.models[name] = entry
            self._loaded.notify_all()

    def remove(self, name: str) -> FollowerModel | None:
        with self._loaded:
            return self.models.pop(name, None)

    def _model(self, name: str) -> FollowerModel:
        """The model, once this rank's load of it has finished (the first rank may be faster)."""
        with self._loaded:
            self._loaded.wait_for(lambda: name in self.models)
            return self.models[name]

    def run(self) -> None:
        """Run ops until the group breaks up (the first rank exits): then this process ends too."""
        while True:
            op = _broadcast(None)
            if isinstance(op, Forward):
                entry = self._model(op.model)
                entry.model(op.input_ids, op.positions, entry.kv_caches, op.batch)
            elif isinstance(op, CopyBlock):
                copy_block(self._model(op.model).kv_caches, op.source, op.destination)
            elif isinstance(op, Decommit):
                self.kv_pool.decommit(op.start, op.end)

