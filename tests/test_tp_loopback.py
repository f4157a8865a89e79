"""A tensor-parallel group's sockets listen on loopback: a real two-rank gloo group (two processes
joining as engine workers do, engine/tensor_parallel.join_group), whose processes' sockets are read
with psutil while the group is up. The control: with the operator's GLOO_SOCKET_IFNAME naming the
host's other interface (a multi-node group), the same probe sees that interface's address, so the
probe tells the two apart."""

from __future__ import annotations

import multiprocessing
import os
import socket

import psutil
import pytest

from gpushare.protocol.messages import GroupSpec

WORLD_SIZE = 2
TIMEOUT_S = 60
LOOPBACK = {"127.0.0.1", "::1"}


def _rank(rank: int, init_file: str, env: dict, ready, done) -> None:
    """One rank: join, one all-reduce, then hold the group open until the parent has looked."""
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    from gpushare.engine import tp_runtime as tensor_parallel

    tensor_parallel.join_group(GroupSpec(rank, WORLD_SIZE, init_file, ["cpu:0", "cpu:1"]), "cpu")
    x = torch.ones(4)
    dist.all_reduce(x)  # through gloo itself, not the shared-memory path
    ready.put((rank, float(x[0])))
    done.wait(TIMEOUT_S)
    dist.destroy_process_group()


def group_addresses(tmp_path, monkeypatch, env: dict) -> set[str]:
    """The local addresses of every inet socket the two ranks hold while their group is up."""
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)  # the ranks' environment chooses nothing but `env`
    ctx = multiprocessing.get_context("spawn")
    ready, done = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "rendezvous"), env, ready, done)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        sums = sorted(ready.get(timeout=TIMEOUT_S) for _ in procs)
        assert sums == [(0, 2.0), (1, 2.0)]  # a working group
        addresses = {c.laddr.ip for p in procs for c in psutil.Process(p.pid).net_connections(kind="inet")}
        assert addresses, "the ranks hold no sockets: the probe saw nothing"
        return addresses
    finally:
        done.set()
        for p in procs:
            p.join(TIMEOUT_S)
            if p.is_alive():
                p.kill()


def other_interface() -> tuple[str, str] | None:
    """(name, IPv4 address) of an interface other than loopback, if the host has one."""
    for name, addresses in psutil.net_if_addrs().items():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return name, a.address
    return None


def test_a_single_node_group_listens_on_loopback_only(tmp_path, monkeypatch):
    addresses = group_addresses(tmp_path, monkeypatch, {})
    assert addresses <= LOOPBACK, f"the group's sockets are bound beyond loopback: {addresses}"


def test_an_operators_interface_is_kept_and_the_probe_sees_it(tmp_path, monkeypatch):
    other = other_interface()
    if other is None:
        pytest.skip("this host has no interface but loopback")
    name, address = other
    assert address in group_addresses(tmp_path, monkeypatch, {"GLOO_SOCKET_IFNAME": name})
