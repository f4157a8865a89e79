"""A tensor-parallel group's runtime: the ranks' process group, the first rank's model that tells
the others what to run, and the loop the other ranks run.

Every rank is an engine worker process (engine/worker.py) on its own device. The supervisor loads
and unloads a model on every rank (each builds its part: models/tp_weights.py); the first
rank alone runs an Engine (scheduler, paged KV bookkeeping, sampling). Each forward pass it runs,
it first broadcasts (``Forward``: the model's name, token ids, positions and attention layout),
then every rank runs the same layers, meeting in the all-reduce after each attention and MLP
block. The other ranks keep their KV heads at the same block ids, so one block table serves all.
Communication is torch.distributed: gloo between CPU ranks, NCCL between GPUs.

A group is the ranks of one node, so its sockets listen on loopback only (``bind_to_loopback``:
gloo's and NCCL's interface, the master address): torch.distributed would otherwise listen on the
address the host name resolves to, and the ranks unpickle the ops that arrive (``broadcast_op``).
An operator who sets GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME / MASTER_ADDR keeps them (a
multi-node group: docs/security.md says what that exposes).

A step's layers run without pausing: the ranks would need a message per layer to agree on where
a pause falls. Collectives are issued from one thread on each rank (the engine thread on the
first, the loop thread on the others), as process groups need.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import logging
import os
import pickle
import socket
import threading
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from gpushare.engine import shm_all_reduce
from gpushare.engine.kv_pool import copy_block
from gpushare.protocol.messages import GroupSpec
from gpushare.models.llama import AttentionBatch

log = logging.getLogger("gpushare.tensor_parallel")

# Ranks wait for their next op without a deadline: a quiet daemon sends none for days.
IDLE_TIMEOUT = datetime.timedelta(days=3650)


@dataclass
class Forward:
    model: str
    input_ids: torch.Tensor
    positions: torch.Tensor
    batch: AttentionBatch


@dataclass
class Logits:
    model: str
    rows: torch.Tensor  # of the last forward pass's final hidden states


@dataclass
class CopyBlock:
    model: str
    source: int
    destination: int


@dataclass
class Decommit:
    start: int
    end: int


@dataclass
class _Group:
    """This process's place in its group, once joined."""

    rank: int = 0
    world_size: int = 1
    ops: object = None  # the process group ops travel in: gloo, also beside NCCL (ops are host objects)
    shm: object = None  # CPU ranks: shm_all_reduce.ShmAllReduce


_group = _Group()


LOOPBACK_SETTINGS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def loopback_interface() -> str:
    """The name of the interface holding 127.0.0.1 ("lo" on Linux)."""
    import psutil  # only a tensor-parallel group needs it: a worker alone does not load it
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addresses):
            return name
    return "lo"


def bind_to_loopback(environ=os.environ) -> None:
    """Make this process's torch.distributed sockets (gloo's, NCCL's bootstrap) listen on loopback,
    unless the operator chose an interface; the master address likewise."""
    interface = loopback_interface()
    for name in LOOPBACK_SETTINGS:
        environ.setdefault(name, interface)
    environ.setdefault("MASTER_ADDR", "127.0.0.1")


def join_group(spec: GroupSpec, device: str) -> None:
    """Join the group's process group (its sockets on loopback: bind_to_loopback); blocks until every
    rank has."""
    bind_to_loopback()
    on_gpu = device.startswith("cuda")
    if on_gpu:
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"file://{spec.init_file}", rank=spec.rank,
                            world_size=spec.world_size, timeout=IDLE_TIMEOUT)
    ops = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT) if on_gpu else None
    _group.rank, _group.world_size, _group.ops = spec.rank, spec.world_size, ops
    if not on_gpu and shm_all_reduce.supported():
        path = f"/dev/shm/gpushare-tp-{hashlib.sha1(spec.init_file.encode()).hexdigest()[:16]}"
        if spec.rank == 0:
            _group.shm = shm_all_reduce.ShmAllReduce(path, 0, spec.world_size)
        dist.barrier()
        if spec.rank > 0:
            _group.shm = shm_all_reduce.ShmAllReduce(path, spec.rank, spec.world_size)
        dist.barrier()
        if spec.rank == 0:
            _group.shm.unlink()
    log.info("rank %d of %d joined its group (%s) over %s, all-reduce %s", spec.rank, spec.world_size,
             ", ".join(spec.devices), "nccl" if on_gpu else "gloo",
             "in shared memory" if _group.shm else "by torch.distributed")


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the ranks, in place; bit for bit the same on every rank.

    CPU ranks: through shared memory (shm_all_reduce.py: microseconds, where gloo's all_reduce
    takes 0.5-1.5 ms a call on a 2-core machine and a step makes two per layer). GPUs, and CPUs
    where that cannot run: torch.distributed's all_reduce (NCCL, gloo).
    """
    if _group.shm is not None:
        return _group.shm(x)
    dist.all_reduce(x)
    return x


def gather_logits(part: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
    """The ranks' vocabulary slices of the logits, ``[rows, widths[r]]`` each, joined on the first
    rank (None on the others)."""
    if _group.shm is not None:
        return _group.shm.gather_columns(part, widths)
    padded = torch.zeros(part.shape[0], max(widths), dtype=part.dtype, device=part.device)
    padded[:, :part.shape[1]] = part
    parts = [torch.empty_like(padded) for _ in widths]
    dist.all_gather(parts, padded)
    return torch.cat([p[:, :w] for p, w in zip(parts, widths)], dim=1) if _group.rank == 0 else None


def use_all_reduce(model: nn.Module) -> None:
    """Sum every decoder block's partial output over the group."""
    for layer in model.layers:
        layer.reduce = all_reduce


# An op's pickled bytes travel in one message of this size when they fit (a decode step's do many
# times over), else in a second one with the rest: one send per rank instead of the two of
# broadcast_object_list.
OP_MESSAGE_BYTES = 16 << 10


def _map_leaves(obj, kind: type, fn):
    """``obj`` (an op: dataclasses, tuples, lists) with ``fn`` applied to every ``kind`` inside."""
    if isinstance(obj, kind):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _map_leaves(getattr(obj, f.name), kind, fn)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_leaves(x, kind, fn) for x in obj)
    return obj


def encode_op(op) -> bytes:
    """``op`` pickled with every tensor as a host numpy array: the bytes name no device (a pickled
    CUDA tensor unpickles onto the sender's device index, another rank's GPU)."""
    return pickle.dumps(_map_leaves(op, torch.Tensor, lambda t: t.cpu().numpy()))


def decode_op(data: bytes, device) -> object:
    """The op of ``encode_op``'s bytes, its tensors on ``device`` (the receiving rank's)."""
    return _map_leaves(pickle.loads(data), np.ndarray,
                       lambda a: torch.from_numpy(a).to(device))  # host: unpickled, then moved to device


def broadcast_op(op, device="cpu") -> object:
    """The first rank sends ``op`` to every other; the others return what it sent (``op`` ignored),
    its tensors on their ``device``.

    Over gloo even between CPU ranks: a rank waiting for its next op then sleeps in a socket read,
    costing nothing while the group is idle. Through shared memory it was no faster, measured
    (58-61 against 50-60 tok/s single-stream, the same runs alternating), and would have to poll.
    """
    head = torch.zeros(OP_MESSAGE_BYTES, dtype=torch.uint8)  # host: ops go over gloo
    if _group.rank == 0:
        data = torch.frombuffer(bytearray(encode_op(op)), dtype=torch.uint8)  # host: as head
        size = data.numel()
        head[:8] = torch.tensor([size], dtype=torch.int64).view(torch.uint8)  # host: as head
        first = min(size, OP_MESSAGE_BYTES - 8)
        head[8:8 + first] = data[:first]
        for r in range(1, _group.world_size):
            dist.send(head, r, group=_group.ops)
            if size > first:
                dist.send(data[first:], r, group=_group.ops)
        return op
    dist.recv(head, 0, group=_group.ops)
    size = int(head[:8].view(torch.int64))
    first = min(size, OP_MESSAGE_BYTES - 8)
    data = head[8:8 + first]
    if size > first:
        rest = torch.empty(size - first, dtype=torch.uint8)  # host: as head
        dist.recv(rest, 0, group=_group.ops)
        data = torch.cat([data, rest])
    return decode_op(data.numpy().tobytes(), device)


class LeaderModel(nn.Module):
    """The first rank's part of a model, with its model's surface (start, run_layers, finish,
    logits, forward): each forward pass is broadcast to the other ranks before it runs here."""

    def __init__(self, name: str, inner: nn.Module, vocab_widths: list[int]):
        super().__init__()
        self.name = name
        self.inner = inner
        self.vocab_widths = vocab_widths  # each rank's slice of lm_head

    def start(self, input_ids, positions, batch: AttentionBatch):
        broadcast_op(Forward(self.name, input_ids, positions, batch))
        return self.inner.start(input_ids, positions, batch)

    def run_layers(self, state, kv_caches, should_pause=None) -> bool:
        return self.inner.run_layers(state, kv_caches)

    def finish(self, state):
        return self.inner.finish(state)

    def logits(self, hidden, rows=None):
        rows = torch.arange(hidden.shape[0], device=hidden.device) if rows is None else rows
        broadcast_op(Logits(self.name, rows))
        return gather_logits(self.inner.logits(hidden, rows), self.vocab_widths)

    def forward(self, input_ids, positions, kv_caches, batch: AttentionBatch):
        state = self.start(input_ids, positions, batch)
        self.run_layers(state, kv_caches)
        return self.finish(state)

    def mirror_copy_block(self, source: int, destination: int) -> None:
        broadcast_op(CopyBlock(self.name, source, destination))


def broadcast_decommit(start: int, end: int) -> None:
    """The first rank's KV pool gave bytes back: so do the others (engine thread)."""
    broadcast_op(Decommit(start, end))


@dataclass
class FollowerModel:
    model: nn.Module
    kv_caches: list
    vocab_widths: list[int]
    hidden: torch.Tensor | None = None  # of its last forward pass: what Logits ops read


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
            op = broadcast_op(None, self.kv_pool.device)
            if isinstance(op, Forward):
                entry = self._model(op.model)
                entry.hidden = entry.model(op.input_ids, op.positions, entry.kv_caches, op.batch)
            elif isinstance(op, Logits):
                entry = self._model(op.model)
                gather_logits(entry.model.logits(entry.hidden, op.rows), entry.vocab_widths)
            elif isinstance(op, CopyBlock):
                copy_block(self._model(op.model).kv_caches, op.source, op.destination)
            elif isinstance(op, Decommit):
                self.kv_pool.decommit(op.start, op.end)

