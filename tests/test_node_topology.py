"""Topology read from sysfs: built trees in the real formats, captured real machines, this machine's /sys."""

import os
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "node"))
import make_sysfs_trees  # noqa: E402
from node_fakes import TREES, sysfs_root  # noqa: E402

from gpushare.node.topology import (  # noqa: E402
    format_cpulist, normalize_pci_bus_id, parse_cpulist, parse_cpumask, read_topology,
)


def primaries(topology, kind):
    return [core.cpus[0] for core in topology.cores if core.kind == kind]


def test_cpulist_and_cpumask_formats():
    assert parse_cpulist("0-7,16-23\n") == list(range(8)) + list(range(16, 24))
    assert parse_cpulist("0,16") == [0, 16]
    assert parse_cpulist("0-7\n\0") == list(range(8))  # old kernels end node lists with a NUL byte
    assert parse_cpulist("") == []
    with pytest.raises(ValueError):
        parse_cpulist("0-x")
    assert parse_cpumask("0000,00000000,00000000,00ff00ff") == list(range(8)) + list(range(16, 24))
    assert parse_cpumask("ff00ff00") == list(range(8, 16)) + list(range(24, 32))
    assert format_cpulist([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_nvml_bus_ids_map_to_sysfs_names():
    assert normalize_pci_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_pci_bus_id("00000035:05:00.0") == "0035:05:00.0"
    assert normalize_pci_bus_id("0000:3b:00.0") == "0000:3b:00.0"
    assert normalize_pci_bus_id("00010000:01:00.0") == "10000:01:00.0"  # VMD domains have 5 digits in sysfs
    with pytest.raises(ValueError):
        normalize_pci_bus_id("GPU-b4895dbf")


def test_hybrid_i9_12900k_core_types_from_cpu_core_and_cpu_atom():
    topology = read_topology(sysfs_root("i9-12900k-rtx4090"))
    assert topology.cpus == list(range(24))
    assert primaries(topology, "P") == [0, 2, 4, 6, 8, 10, 12, 14]
    assert primaries(topology, "E") == list(range(16, 24))
    assert [core.cpus for core in topology.cores[:2]] == [[0, 1], [2, 3]]
    assert topology.kind_source == "sys/devices/cpu_core and cpu_atom"
    assert topology.hybrid
    assert topology.core_of(5).max_freq_khz == 5200000  # a favoured core is still just a P-core
    assert topology.l3_domains == [list(range(24))]
    assert topology.numa_nodes == {0: list(range(24))}
    [gpu] = topology.nvidia_gpus  # the RTX 4090's audio function 01:00.1 is not a GPU
    assert (gpu.bus_id, gpu.numa_node, gpu.local_cpus) == ("0000:01:00.0", None, list(range(24)))


def test_dual_socket_server_with_four_gpus_on_two_nodes():
    topology = read_topology(sysfs_root("xeon-2s-4xh100"))
    node0, node1 = list(range(8)) + list(range(16, 24)), list(range(8, 16)) + list(range(24, 32))
    assert topology.packages == {0: node0, 1: node1}
    assert topology.numa_nodes == {0: node0, 1: node1}
    assert topology.l3_domains == [node0, node1]
    assert [core.cpus for core in topology.cores] == [[c, c + 16] for c in range(16)]
    assert primaries(topology, "E") == [] and topology.kinds_known
    assert [(g.bus_id, g.numa_node) for g in topology.nvidia_gpus] == [
        ("0000:18:00.0", 0), ("0000:2a:00.0", 0), ("0000:9a:00.0", 1), ("0000:ab:00.0", 1)]
    device = topology.pci_device("00000000:9A:00.0")
    assert (device.numa_node, device.local_cpus) == (1, node1)
    assert topology.pci_device("00000000:3B:00.0") is None


def test_epyc_l3_domains_are_the_four_ccds():
    topology = read_topology(sysfs_root("epyc-7313-4xh100"))
    assert topology.l3_domains == [[0, 1, 2, 3, 16, 17, 18, 19], [4, 5, 6, 7, 20, 21, 22, 23],
                                   [8, 9, 10, 11, 24, 25, 26, 27], [12, 13, 14, 15, 28, 29, 30, 31]]
    assert [core.l3 for core in topology.cores] == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    assert topology.numa_nodes == {0: list(range(32))}
    assert len(topology.nvidia_gpus) == 4


def test_real_raptor_lake_falls_back_to_max_frequency():
    # hwloc's capture of an i7-1370P: no cpu_core/cpu_atom; max freq 5.2 GHz (favoured), 5.0 GHz, 3.9 GHz.
    topology = read_topology(sysfs_root("raptorlake-i7-1370p"))
    assert primaries(topology, "P") == [0, 2, 4, 6, 8, 10]
    assert primaries(topology, "E") == list(range(12, 20))
    assert "cpuinfo_max_freq" in topology.kind_source and "5000 MHz" in topology.kind_source


def test_real_dgx_spark_big_little_from_max_frequency():
    topology = read_topology(sysfs_root("dgx-spark-gb10"))
    assert primaries(topology, "P") == [5, 6, 7, 8, 9, 15, 16, 17, 18, 19]
    assert primaries(topology, "E") == [0, 1, 2, 3, 4, 10, 11, 12, 13, 14]
    assert topology.packages == {36: list(range(20))}
    assert topology.l3_domains == [list(range(10)), list(range(10, 20))]


def test_real_opteron_eight_nodes_with_nul_terminated_lists():
    topology = read_topology(sysfs_root("opteron-4s-8numa"))
    assert topology.numa_nodes == {n: list(range(8 * n, 8 * n + 8)) for n in range(8)}
    assert topology.l3_domains == [list(range(8 * n, 8 * n + 8)) for n in range(8)]
    assert len(topology.cores) == 32  # thread_siblings_list pairs the two cores of each module
    assert not topology.kinds_known


def test_real_power9_trims_node_lists_and_reads_masks():
    topology = read_topology(sysfs_root("power9-6xv100"))
    assert topology.cpus == list(range(16)) + list(range(88, 104))
    assert topology.numa_nodes == {0: list(range(16)), 8: list(range(88, 104))}  # GPU memory nodes have no CPU
    assert topology.l3_domains == [list(range(8)), list(range(8, 16)), list(range(88, 96)), list(range(96, 104))]
    assert [core.cpus for core in topology.cores[:2]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    device = topology.pci_device("00000035:05:00.0")  # only class and local_cpus were captured
    assert (device.numa_node, device.local_cpus) == (None, list(range(88, 104)))


def test_real_ryzen_two_ccx_without_cpu_online_file():
    topology = read_topology(sysfs_root("ryzen5-1600"))
    assert topology.cpus == list(range(12))
    assert [core.cpus for core in topology.cores] == [[c, c + 6] for c in range(6)]
    assert topology.l3_domains == [[0, 1, 2, 6, 7, 8], [3, 4, 5, 9, 10, 11]]


def test_real_vm_nvidia_gpu_with_numa_node_minus_one():
    topology = read_topology(sysfs_root("vm-p100"))
    [gpu] = topology.nvidia_gpus  # the virtio VGA device is not NVIDIA's
    assert (gpu.bus_id, gpu.pci_class) == ("0000:06:00.0", "0x030200")
    assert (gpu.numa_node, gpu.local_cpus) == (None, list(range(8)))


def test_built_trees_are_what_their_generator_writes():
    assert make_sysfs_trees.main(["--check"]) == 0


def test_missing_topology_is_reported_not_fatal(tmp_path):
    (tmp_path / "sys/devices/system/cpu").mkdir(parents=True)
    (tmp_path / "sys/devices/system/cpu/online").write_text("0-3\n")
    topology = read_topology(tmp_path)
    assert [core.cpus for core in topology.cores] == [[0], [1], [2], [3]]
    assert not topology.kinds_known and topology.numa_nodes == {}
    assert any("no CPU topology" in note for note in topology.notes)
    assert any("no NUMA information" in note for note in topology.notes)


def test_this_machine_live_sys():
    topology = read_topology("/")
    online = parse_cpulist(Path("/sys/devices/system/cpu/online").read_text())
    assert topology.cpus == online
    assert sorted(cpu for core in topology.cores for cpu in core.cpus) == online
    assert len(online) == os.cpu_count()
    if Path("/sys/devices/system/node/node0").exists():
        assert sorted(cpu for cpus in topology.numa_nodes.values() for cpu in cpus) == online


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TREES))
def test_partial_extraction_reads_like_the_whole_tree(name):
    # node_fakes extracts only the files the reader opens; the whole tree must read the same.
    def facts(root):
        data = asdict(read_topology(root))
        data.pop("root")
        return data
    assert facts(sysfs_root(name)) == facts(sysfs_root(name, whole=True))
