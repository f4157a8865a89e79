"""CPU pinning plans, asserted exactly, on built, captured and live sysfs trees."""

import os
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "node"))
from node_fakes import sysfs_root  # noqa: E402

from gpushare.node.affinity import EngineTarget, EnginePinning, apply_thread_affinity, plan_pinning  # noqa: E402
from gpushare.node.node_settings import NodeSettings  # noqa: E402
from gpushare.node.topology import read_topology  # noqa: E402

SIBLINGS_NOTE = "no spare core: HTTP and tokenisation run on the SMT siblings of engine cores"
NO_HYBRID_NOTE = "no hybrid information in sysfs (no cpu_core/cpu_atom, no cpufreq): all cores treated as P-cores"
XEON = {f"GPU-{bus}": f"00000000:{bus}:00.0" for bus in ("18", "2A", "9A", "AB")}
EPYC = {f"GPU-{bus}": f"00000000:{bus}:00.0" for bus in ("01", "41", "81", "C1")}


def gpus(table, *names):
    return [EngineTarget(name, table[name]) for name in names]


def r(first, last):
    return list(range(first, last + 1))


def test_hybrid_engine_gets_one_thread_per_p_core_and_http_the_e_cores():
    topology = read_topology(sysfs_root("i9-12900k-rtx4090"))
    plan = plan_pinning(topology, engines=[EngineTarget("GPU-4090", "00000000:01:00.0")])
    assert plan.engines == [EnginePinning("GPU-4090", [0, 2, 4, 6, 8, 10, 12, 14], 8, 0)]
    assert plan.other_cpus == r(16, 23)
    assert plan.notes == []
    cpu_plan = plan_pinning(topology)  # no GPU: one CPU engine, same choice
    assert cpu_plan.engines == [EnginePinning("cpu", [0, 2, 4, 6, 8, 10, 12, 14], 8, 0)]
    assert cpu_plan.other_cpus == r(16, 23)


def test_dual_socket_four_gpus_get_node_local_cores():
    topology = read_topology(sysfs_root("xeon-2s-4xh100"))
    plan = plan_pinning(topology, engines=gpus(XEON, "GPU-18", "GPU-2A", "GPU-9A", "GPU-AB"))
    assert plan.engines == [
        EnginePinning("GPU-18", r(0, 3), 4, 0), EnginePinning("GPU-2A", r(4, 7), 4, 0),
        EnginePinning("GPU-9A", r(8, 11), 4, 1), EnginePinning("GPU-AB", r(12, 15), 4, 1),
    ]
    assert plan.other_cpus == r(16, 31)
    assert plan.notes == [SIBLINGS_NOTE]


def test_dual_socket_one_gpu_on_node_1_leaves_node_0_to_http():
    topology = read_topology(sysfs_root("xeon-2s-4xh100"))
    plan = plan_pinning(topology, engines=gpus(XEON, "GPU-AB"))
    assert plan.engines == [EnginePinning("GPU-AB", r(8, 15), 8, 1)]
    assert plan.engine("GPU-AB").cpus == r(8, 15)  # how an engine thread finds its CPUs
    assert plan.other_cpus == r(0, 7) + r(16, 23)
    assert plan.notes == []


def test_dual_socket_cpu_engine_spans_both_nodes_and_says_so():
    plan = plan_pinning(read_topology(sysfs_root("xeon-2s-4xh100")))
    assert plan.engines == [EnginePinning("cpu", r(0, 15), 16, None)]
    assert plan.notes == ["cpu: its CPUs span NUMA nodes 0-1", SIBLINGS_NOTE]


def test_dual_socket_mig_instances_share_their_gpu_locality():
    topology = read_topology(sysfs_root("xeon-2s-4xh100"))
    engines = [EngineTarget("MIG-a", XEON["GPU-18"]), EngineTarget("MIG-b", XEON["GPU-18"])] + gpus(XEON, "GPU-9A")
    plan = plan_pinning(topology, engines=engines)
    assert plan.engines == [EnginePinning("MIG-a", r(0, 3), 4, 0), EnginePinning("MIG-b", r(4, 7), 4, 0),
                            EnginePinning("GPU-9A", r(8, 15), 8, 1)]
    assert plan.other_cpus == r(16, 31)


def test_epyc_engines_get_whole_ccds():
    topology = read_topology(sysfs_root("epyc-7313-4xh100"))
    four = plan_pinning(topology, engines=gpus(EPYC, "GPU-01", "GPU-41", "GPU-81", "GPU-C1"))
    assert [(e.engine, e.cpus) for e in four.engines] == [
        ("GPU-01", r(0, 3)), ("GPU-41", r(4, 7)), ("GPU-81", r(8, 11)), ("GPU-C1", r(12, 15))]
    assert four.other_cpus == r(16, 31) and four.notes == [SIBLINGS_NOTE]
    # Three engines on four CCDs: 2 + 1 + 1 CCDs, never 6 + 5 + 5 cores across CCD boundaries.
    three = plan_pinning(topology, engines=gpus(EPYC, "GPU-01", "GPU-41", "GPU-81"))
    assert [(e.engine, e.cpus, e.torch_threads) for e in three.engines] == [
        ("GPU-01", r(0, 7), 8), ("GPU-41", r(8, 11), 4), ("GPU-81", r(12, 15), 4)]
    one = plan_pinning(topology, engines=gpus(EPYC, "GPU-41"))
    assert one.engines == [EnginePinning("GPU-41", r(0, 15), 16, 0)]


def test_node_cpus_overrides_the_choice():
    topology = read_topology(sysfs_root("xeon-2s-4xh100"))
    plan = plan_pinning(topology, NodeSettings(cpus=[2, 3, 4, 5]), engines=gpus(XEON, "GPU-18", "GPU-9A"))
    assert plan.engines == [EnginePinning("GPU-18", [2, 3], 2, 0), EnginePinning("GPU-9A", [4, 5], 2, 0)]
    assert plan.other_cpus == [0, 1] + r(6, 31)
    assert plan.notes == ["node.cpus overrides the automatic choice: engines run on CPUs 2-5"]
    with pytest.raises(ValueError, match=r"node.cpus: CPU 40 is not online \(online: 0-31\)"):
        plan_pinning(topology, NodeSettings(cpus=[1, 40]))
    with pytest.raises(ValueError, match="node.cpus: CPU 8 is outside this process's affinity"):
        plan_pinning(topology, NodeSettings(cpus=[7, 8]), allowed_cpus=r(0, 7))


def test_process_affinity_limits_the_plan():
    topology = read_topology(sysfs_root("i9-12900k-rtx4090"))
    plan = plan_pinning(topology, allowed_cpus=r(0, 3))
    assert plan.engines == [EnginePinning("cpu", [0, 2], 2, 0)]
    assert plan.other_cpus == [1, 3]
    assert plan.notes == ["process affinity limits gpushare to CPUs 0-3", SIBLINGS_NOTE]


def test_affinity_with_only_e_cores_says_so():
    plan = plan_pinning(read_topology(sysfs_root("i9-12900k-rtx4090")), allowed_cpus=r(16, 23))
    assert plan.engines == [EnginePinning("cpu", r(16, 23), 8, 0)]
    assert plan.notes == ["process affinity limits gpushare to CPUs 16-23",
                          "cpu: no P-core among the allowed CPUs; using E-cores",
                          "no spare CPU: HTTP and tokenisation share the engine cores"]


def test_real_raptor_lake_uses_p_cores_found_by_frequency():
    plan = plan_pinning(read_topology(sysfs_root("raptorlake-i7-1370p")))
    assert plan.engines == [EnginePinning("cpu", [0, 2, 4, 6, 8, 10], 6, 0)]
    assert plan.other_cpus == r(12, 19)
    assert plan.notes == []


def test_real_power9_six_gpus_by_local_cpus_mask():
    topology = read_topology(sysfs_root("power9-6xv100"))
    buses = ["00000004:05:00.0", "00000004:06:00.0", "00000006:00:00.0",
             "00000007:00:00.0", "00000035:04:00.0", "00000035:05:00.0"]
    plan = plan_pinning(topology, engines=[EngineTarget(f"GPU{i}", bus) for i, bus in enumerate(buses)])
    assert [(e.engine, e.cpus, e.numa_node) for e in plan.engines] == [
        ("GPU0", [0, 4], 0), ("GPU1", [8], 0), ("GPU2", [12], 0),
        ("GPU3", [88, 92], 8), ("GPU4", [96], 8), ("GPU5", [100], 8)]
    assert plan.notes[0].startswith("no hybrid information in sysfs")
    assert ("GPU0: sysfs gives no NUMA node for 0004:05:00.0 (numa_node -1 or missing); "
            "using its local CPUs 0-15") in plan.notes


def test_real_vm_with_one_gpu_and_no_spare_core():
    plan = plan_pinning(read_topology(sysfs_root("vm-p100")), engines=[EngineTarget("GPU-P100", "00000000:06:00.0")])
    assert plan.engines == [EnginePinning("GPU-P100", r(0, 7), 8, 0)]
    assert plan.other_cpus == r(0, 7)
    assert plan.notes == [NO_HYBRID_NOTE, "no spare CPU: HTTP and tokenisation share the engine cores"]
    crowded = plan_pinning(read_topology(sysfs_root("vm-p100")),
                           engines=[EngineTarget(f"MIG-{i}", "00000000:06:00.0") for i in range(9)])
    assert [e.cpus for e in crowded.engines] == [[i] for i in range(8)] + [[0]]
    names = ", ".join(f"MIG-{i}" for i in range(9))
    assert f"{names}: 8 core(s) for 9 engines; engines share cores" in crowded.notes


def test_without_topology_it_falls_back_to_all_cores_and_says_so(tmp_path):
    (tmp_path / "sys/devices/system/cpu").mkdir(parents=True)
    (tmp_path / "sys/devices/system/cpu/online").write_text("0-3\n")
    plan = plan_pinning(read_topology(tmp_path), engines=[EngineTarget("GPU-x", "00000000:3B:00.0")])
    assert plan.engines == [EnginePinning("GPU-x", r(0, 3), 4, None)]
    assert plan.other_cpus == r(0, 3)
    assert plan.notes == [
        NO_HYBRID_NOTE,
        "no NUMA information in sysfs: every GPU treated as local to all CPUs",
        "GPU-x: PCI device 00000000:3B:00.0 not found in sysfs; treated as local to all CPUs",
        "no spare CPU: HTTP and tokenisation share the engine cores",
    ]


def test_this_machine_plan_and_thread_pinning():
    allowed = sorted(os.sched_getaffinity(0))
    topology = read_topology("/")
    plan = plan_pinning(topology, allowed_cpus=allowed)
    [engine] = plan.engines
    cores = {topology.core_of(cpu).cpus[0] for cpu in allowed}
    assert len(engine.cpus) == engine.torch_threads == len(cores)  # one thread per physical core
    assert set(engine.cpus) <= set(allowed) and plan.other_cpus and set(plan.other_cpus) <= set(allowed)

    seen = {}

    def engine_thread():
        apply_thread_affinity([allowed[-1]])
        seen["engine"] = os.sched_getaffinity(0)

    worker = threading.Thread(target=engine_thread)
    worker.start()
    worker.join()
    assert seen["engine"] == {allowed[-1]}
    assert sorted(os.sched_getaffinity(0)) == allowed  # only that thread was pinned
