"""Tensor-parallel groups: `nvidia-smi topo -m` parsed from real captures (two fragments) and a
constructed mixed-PCIe board, and the devices chosen for each model over real worker plans."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "node"))
from node_fakes import (XEON_GPUS, FakeNvml, Recorded, ReplayRunner, h100_node_gpus, h100_with_mig,  # noqa: E402
                        recorded, sysfs_root)

from gpushare.settings.settings import ModelEntry  # noqa: E402
from gpushare.node.devices import plan_workers  # noqa: E402
from gpushare.node.gpu import read_gpus  # noqa: E402
from gpushare.node.gpu_links import GpuLinks, link_rank, parse_topo_matrix, read_gpu_links  # noqa: E402
from gpushare.node.runner import NodeError  # noqa: E402
from gpushare.node.topology import parse_cpulist, read_topology  # noqa: E402
from gpushare.node.tp_groups import plan_tp_group, plan_tp_groups  # noqa: E402

GIB = 2**30
NV18_BOARD = "8gpu-nv18_nvidia-smi-topo-m_fragment.txt"
DGX_A100 = "dgx-a100-40gb_nvidia-smi-topo-m_fragment.txt"
MIXED_PCIE = "4gpu-mixed-pcie_nvidia-smi-topo-m.txt"
CROSS_SOCKET = ("all-reduces over the inter-socket link run several times slower than over NVLink or a PCIe "
                "switch, after every split layer; set models[0].tensor_parallel_cross_numa: true to accept")


def links_of(name):
    return parse_topo_matrix(recorded(name).stdout)


def nv18_board():
    """The eight H100 of the 8xH100 capture on the two-socket tree, with the NV18 board's links."""
    report, topology = read_gpus(FakeNvml(h100_node_gpus())), read_topology(sysfs_root("xeon-2s-8xh100"))
    return plan_workers(None, report, topology), links_of(NV18_BOARD)


def mixed_pcie():
    report, topology = read_gpus(FakeNvml(XEON_GPUS)), read_topology(sysfs_root("xeon-2s-4xh100"))
    return plan_workers(None, report, topology), links_of(MIXED_PCIE)


def model(name, size=1, devices=None, cross_numa=False):
    return ModelEntry(name, "", tensor_parallel=size, tensor_parallel_devices=devices,
                      tensor_parallel_cross_numa=cross_numa)


def names(group):
    return [w.name for w in group.workers]


def test_the_nv18_fragment_fills_missing_rows_from_the_columns():
    links = links_of(NV18_BOARD)
    assert links.gpus == list(range(8))
    assert {links.link(a, b) for a in range(6) for b in range(8) if a != b} == {"NV18"}
    assert links.link(6, 0) == links.link(7, 5) == "NV18"  # GPU6/7 have no row: from the other rows' columns
    assert links.link(6, 7) == "unknown"  # nobody says
    assert links.link(3, 3) == "X"
    assert links.numa_affinity == {0: 0, 1: 0, 2: 0, 3: 1, 4: 2, 5: 2}
    assert links.cpu_affinity[3] == parse_cpulist("24-47,120-143")
    assert all(a < 8 and b < 8 for a, b in links.cells)  # NIC columns ignored


def test_the_dgx_a100_fragment():
    links = links_of(DGX_A100)
    assert links.link(0, 7) == links.link(2, 3) == "NV12"
    assert links.numa_affinity == {0: 3, 1: 3, 2: 1, 3: 1}
    assert links.cpu_affinity[2] == parse_cpulist("16-31,144-159")


def test_the_raw_tab_separated_mixed_pcie_board():
    links = links_of(MIXED_PCIE)
    assert links.gpus == [0, 1, 2, 3]
    assert (links.link(0, 1), links.link(2, 3), links.link(1, 2), links.link(3, 0)) == ("PIX", "PXB", "SYS", "SYS")
    assert links.numa_affinity == {0: 0, 1: 0, 2: 1, 3: 1}


def test_links_rank_nvlink_first_then_the_pcie_path():
    order = ["NV18", "NV12", "NV2", "PIX", "PXB", "PHB", "NODE", "SYS"]
    assert [link_rank(a) > link_rank(b) for a, b in zip(order, order[1:])] == [True] * 7
    assert link_rank("unknown") == link_rank("SYS") == link_rank("SOC")
    assert link_rank("NUMA-local") == link_rank("NODE")


def test_read_gpu_links_runs_nvidia_smi_topo_m():
    runner = ReplayRunner({"nvidia-smi topo -m": recorded(DGX_A100)})
    assert read_gpu_links(runner).link(1, 2) == "NV12"
    assert runner.calls == ["nvidia-smi topo -m"]
    failing = ReplayRunner({"nvidia-smi topo -m": Recorded("NVIDIA-SMI has failed because it couldn't communicate "
                                                           "with the NVIDIA driver.\n", 9)})
    with pytest.raises(NodeError, match=r"^`nvidia-smi topo -m` failed \(exit 9\): NVIDIA-SMI has failed"):
        read_gpu_links(failing)


def test_nv18_board_tp4_is_four_nvlinked_gpus_and_two_tp2_models_use_different_gpus():
    plan, links = nv18_board()
    [group] = plan_tp_groups([model("big", 4)], plan, links)
    assert (names(group), group.link) == (["cuda:0", "cuda:1", "cuda:2", "cuda:3"], "NV18")
    assert group.why == ("cuda:0, cuda:1, cuda:2, cuda:3: the best-linked 4 GPUs of this node, every pair joined by "
                         "at least NVLink (NV18: 18 bonded links); none is in another tensor-parallel group.")
    first, second = plan_tp_groups([model("a", 2), model("plain"), model("b", 2)], plan, links)
    assert (names(first), names(second)) == (["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"])
    assert (first.model, second.link) == ("a", "NV18")


def test_a_pair_nobody_describes_is_taken_as_sys():
    plan, links = nv18_board()
    with pytest.raises(ValueError) as refused:
        plan_tp_groups([model("all", 8)], plan, links)
    assert str(refused.value).startswith(
        "models[0] all: the best-linked 8 GPUs (cuda:0, cuda:1, cuda:2, cuda:3, cuda:4, cuda:5, cuda:6, cuda:7) are "
        "joined only by an unknown path (nvidia-smi topo -m does not say; taken as SYS): ")
    [group] = plan_tp_groups([model("all", 8, cross_numa=True)], plan, links)
    assert group.link == "unknown"


def test_mixed_pcie_tp2_takes_the_pix_pair_and_tp4_crosses_sockets_only_when_allowed():
    plan, links = mixed_pcie()
    first, second = plan_tp_groups([model("a", 2), model("b", 2)], plan, links)
    assert (names(first), first.link, names(second), second.link) == (
        ["cuda:0", "cuda:1"], "PIX", ["cuda:2", "cuda:3"], "PXB")
    assert "every pair joined by at least one PCIe switch (PIX)" in first.why
    assert second.why == ("cuda:2, cuda:3: 2 GPUs in no other tensor-parallel group, every pair joined by at least "
                          "several PCIe switches, not the CPU's host bridge (PXB); the sets linked by PIX share devices "
                          "with other groups.")
    with pytest.raises(ValueError) as refused:
        plan_tp_groups([model("big", 4)], plan, links)
    assert str(refused.value) == (
        "models[0] big: the best-linked 4 GPUs (cuda:0, cuda:1, cuda:2, cuda:3) are joined only by the inter-socket "
        f"link (SYS): {CROSS_SOCKET}")
    [group] = plan_tp_groups([model("big", 4, cross_numa=True)], plan, links)
    assert (names(group), group.link) == (["cuda:0", "cuda:1", "cuda:2", "cuda:3"], "SYS")


def test_a_second_group_shares_devices_only_when_no_better_linked_set_is_free():
    plan, links = mixed_pcie()
    groups = plan_tp_groups([model("a", 2), model("b", 2), model("c", 2)], plan, links)
    assert [names(g) for g in groups] == [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"], ["cuda:0", "cuda:1"]]
    assert "cuda:0, cuda:1 also serve(s) another tensor-parallel group" in groups[2].why


def test_named_devices_keep_their_rank_order():
    plan, links = mixed_pcie()
    [group] = plan_tp_groups([model("a", 2, devices=["cuda:1", "cuda:0"])], plan, links)
    assert (names(group), group.link) == (["cuda:1", "cuda:0"], "PIX")
    assert group.why.startswith("cuda:1, cuda:0: as listed in tensor_parallel_devices; every pair joined by at least one PCIe switch (PIX)")
    with pytest.raises(ValueError, match=r"^models\[0\] a: tensor_parallel_devices: cuda:7: no engine worker runs"):
        plan_tp_groups([model("a", 2, devices=["cuda:0", "cuda:7"])], plan, links)


def test_two_cpu_workers_on_one_numa_node_form_a_group():
    topology = read_topology(sysfs_root("vm-p100"))
    plan = plan_workers(["cpu:0", "cpu:1"], read_gpus(FakeNvml([])), topology, allowed_cpus=[0, 1])
    [group] = plan_tp_groups([model("m", 2)], plan, GpuLinks())
    assert (names(group), group.link) == (["cpu:0", "cpu:1"], "NUMA-local")
    assert "every pair joined by at least the memory of one NUMA node (NUMA-local)" in group.why


def test_cpu_workers_on_two_sockets_need_cross_numa():
    plan = plan_workers(["cpu:0-7", "cpu:8-15"], read_gpus(FakeNvml([])), read_topology(sysfs_root("xeon-2s-4xh100")))
    with pytest.raises(ValueError, match=r"^models\[0\] m: the best-linked 2 CPU workers \(cpu:0-7, cpu:8-15\) are "
                                         r"joined only by the inter-socket link \(SYS\)"):
        plan_tp_groups([model("m", 2)], plan, GpuLinks())
    [group] = plan_tp_groups([model("m", 2, cross_numa=True)], plan, GpuLinks())
    assert group.link == "SYS"


def test_more_devices_than_there_are_or_of_mixed_kinds_is_refused():
    plan, links = nv18_board()
    two = plan.workers[:2]
    with pytest.raises(ValueError) as refused:
        plan_tp_group("big", 4, two, links, False, key="models[3]")
    assert str(refused.value) == "models[3] big: tensor_parallel 4 needs 4 devices, engine.devices has 2 (cuda:0, cuda:1)"
    topology = read_topology(sysfs_root("xeon-2s-4xh100"))
    mixed = plan_workers(["cuda:0", "cpu:8-15"], read_gpus(FakeNvml(XEON_GPUS)), topology)
    with pytest.raises(ValueError) as refused:
        plan_tp_groups([model("m", 2)], mixed, links_of(MIXED_PCIE))
    assert str(refused.value) == ("models[0] m: tensor_parallel 2 needs 2 devices of one kind (a GPU, a MIG instance "
                                  "and a CPU never form a group); the devices are 1 GPUs, 1 CPU workers "
                                  "(cuda:0, cpu:8-15)")


def test_refusals_can_be_collected_while_the_other_models_are_planned():
    plan, links = mixed_pcie()
    refusals = []
    groups = plan_tp_groups([model("big", 4), model("small", 2)], plan, links, refusals=refusals)
    assert [g.model for g in groups] == ["small"] and refusals[0].startswith("models[0] big: the best-linked 4 GPUs")


def test_auto_is_the_fewest_devices_that_hold_the_model():
    plan, links = nv18_board()  # 81559 MiB each
    sizes = {"small": 10 * GIB, "mid": 100 * GIB, "large": 300 * GIB}
    groups = plan_tp_groups([model(name, "auto") for name in sizes], plan, links, need_bytes=sizes)
    assert [names(g) for g in groups] == [["cuda:0"], ["cuda:1", "cuda:2"], ["cuda:3", "cuda:4", "cuda:5", "cuda:6"]]
    assert groups[0].why == "cuda:0: one device holds the model (auto: 1 rank(s) of 10.0 GiB each fit in 79.6 GiB)."
    assert groups[1].why.endswith("; auto: 2 rank(s) of 50.0 GiB each fit in 79.6 GiB.")
    with pytest.raises(ValueError) as refused:
        plan_tp_groups([model("huge", "auto")], plan, links, need_bytes={"huge": 1024 * GIB})
    assert str(refused.value) == ("models[0] huge: tensor_parallel auto: 1024.0 GiB (weights + KV) does not fit split "
                                  "over all 8 GPUs (128.0 GiB each; the largest holds 79.6 GiB)")
    [unsized] = plan_tp_groups([model("unsized", "auto")], plan, links)
    assert names(unsized) == ["cuda:0"] and "the daemon sizes the group when it loads it" in unsized.why


def test_auto_on_cpu_workers_is_one_device():
    plan = plan_workers(["cpu:0", "cpu:1"], read_gpus(FakeNvml([])), read_topology(sysfs_root("vm-p100")),
                        allowed_cpus=[0, 1])
    [group] = plan_tp_groups([model("m", "auto")], plan, GpuLinks(), need_bytes={"m": 100 * GIB})
    assert names(group) == ["cpu:0"] and "CPU workers have no fixed memory size" in group.why


def test_a_fixed_size_leaves_out_devices_too_small_for_a_rank():
    plan, links = nv18_board()
    with pytest.raises(ValueError) as refused:
        plan_tp_groups([model("m", 2)], plan, links, need_bytes={"m": 200 * GIB})
    assert str(refused.value) == ("models[0] m: tensor_parallel 2: each rank holds 100.0 GiB (weights + KV split 2 "
                                  "ways), and only 0 of the GPUs hold that much")


def test_mig_instances_have_no_peer_to_peer_path():
    plan = plan_workers(None, read_gpus(FakeNvml([h100_with_mig()])), read_topology(sysfs_root("vm-p100")))
    [group] = plan_tp_groups([model("m", 2)], plan, GpuLinks())
    assert [w.mig_uuid is not None for w in group.workers] == [True, True]
    assert group.link == "PHB"
