"""Engine worker plans: one worker per GPU, MIG instance or CPU set, on NVML fakes and sysfs
trees built from real captures (tests/fixtures/node/README.md)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "node"))
from node_fakes import FakeNvml, a100_7x1g, h100_node_gpus, h100_with_mig, sysfs_root  # noqa: E402

from gpushare.node.affinity import SIBLINGS_NOTE, SHARED_NOTE, plan_pinning  # noqa: E402
from gpushare.node.devices import WorkerPlan, parse_device, plan_workers  # noqa: E402
from gpushare.node.gpu import read_gpus  # noqa: E402
from gpushare.node.node_settings import parse_node_settings  # noqa: E402
from gpushare.node.topology import read_topology  # noqa: E402

MIB = 2**20
H100_UUIDS = [gpu.uuid for gpu in h100_node_gpus()]
A100_UUID = "GPU-4200ccc0-2667-d4cb-9137-f932c716232a"


def r(first, last):
    return list(range(first, last + 1))


def h100_node():
    return read_gpus(FakeNvml(h100_node_gpus())), read_topology(sysfs_root("xeon-2s-8xh100"))


def test_eight_h100_get_one_worker_each_on_cores_of_their_numa_node():
    report, topology = h100_node()
    plan = plan_workers(None, report, topology)
    assert [w.name for w in plan.workers] == [f"cuda:{i}" for i in range(8)]
    for i, (worker, uuid) in enumerate(zip(plan.workers, H100_UUIDS)):
        assert worker.torch_device == "cuda"
        assert worker.env == {"CUDA_VISIBLE_DEVICES": uuid}
        assert (worker.gpu_uuid, worker.mig_uuid, worker.gpu_index) == (uuid, None, i)
        assert worker.memory_total_bytes == 81559 * MIB
        assert (worker.cpus, worker.torch_threads) == ([2 * i, 2 * i + 1], 2)
        assert worker.numa_node == (0 if i < 4 else 1)
        local = topology.pci_device(report.gpus[i].pci_bus_id).local_cpus
        assert set(worker.cpus) <= set(local)
    assert plan.other_cpus == r(16, 31)  # the SMT siblings of the engine cores
    assert plan.notes == [SIBLINGS_NOTE]


def test_a100_with_seven_1g_instances_gets_a_worker_per_instance():
    report = read_gpus(FakeNvml([a100_7x1g()], driver="450.80.02"))
    plan = plan_workers(None, report, read_topology(sysfs_root("xeon-2s-4xh100")))
    migs = [f"MIG-{A100_UUID}/{gi}/0" for gi in range(7, 14)]
    assert [w.name for w in plan.workers] == migs
    assert [w.env for w in plan.workers] == [{"CUDA_VISIBLE_DEVICES": mig} for mig in migs]
    assert {(w.gpu_uuid, w.gpu_index, w.memory_total_bytes) for w in plan.workers} == {(A100_UUID, 0, 4864 * MIB)}
    assert [w.mig_uuid for w in plan.workers] == migs
    # 16 cores for 7 workers; that tree has no device at the A100's bus id, which the plan says.
    assert [w.cpus for w in plan.workers] == [r(0, 2), r(3, 5), [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert plan.notes[0] == f"{migs[0]}: PCI device 00000000:36:00.0 not found in sysfs; treated as local to all CPUs"


def test_mps_adds_the_client_variables_of_each_devices_daemon():
    node = parse_node_settings({"mps": {"enabled": True, "root": "/run/gpushare/mps"}})
    mig = h100_with_mig()
    plan = plan_workers(None, read_gpus(FakeNvml([mig])), read_topology(sysfs_root("xeon-2s-4xh100")), node)
    first = mig.migs[0].uuid
    assert plan.workers[0].env == {
        "CUDA_VISIBLE_DEVICES": first,
        "CUDA_MPS_PIPE_DIRECTORY": f"/run/gpushare/mps/{first}/pipe",
        "CUDA_MPS_LOG_DIRECTORY": f"/run/gpushare/mps/{first}/log",
    }
    report, topology = h100_node()
    whole = plan_workers(["cuda:5"], report, topology, node).workers[0]
    assert whole.env["CUDA_MPS_PIPE_DIRECTORY"] == f"/run/gpushare/mps/{H100_UUIDS[5]}/pipe"
    assert whole.env["CUDA_VISIBLE_DEVICES"] == H100_UUIDS[5]


def test_cpu_host_with_two_numa_nodes_gets_a_worker_per_node():
    topology = read_topology(sysfs_root("xeon-2s-silver4108-8ve"))  # real capture: 2x Xeon Silver 4108
    plan = plan_workers(None, read_gpus(FakeNvml([])), topology)
    assert plan.workers == [
        WorkerPlan("cpu:0-7", "cpu", {}, r(0, 7), 8, 0),
        WorkerPlan("cpu:8-15", "cpu", {}, r(8, 15), 8, 1),
    ]
    assert plan.other_cpus == r(16, 31)
    # engine.device: cpu ignores the GPUs NVML sees
    report, eight = h100_node()
    assert [w.name for w in plan_workers(None, report, eight, device="cpu").workers] == ["cpu:0-7", "cpu:8-15"]


def test_cpu_host_with_one_node_gets_the_pinning_plans_one_worker():
    topology = read_topology(sysfs_root("i9-12900k-rtx4090"))
    plan = plan_workers(None, read_gpus(FakeNvml([])), topology)
    pinning = plan_pinning(topology)
    assert plan.workers == [WorkerPlan("cpu", "cpu", {}, pinning.engines[0].cpus, 8, 0)]
    assert plan.other_cpus == pinning.other_cpus == r(16, 23)  # the E-cores


def test_two_cpu_entries_on_a_two_cpu_process_get_one_cpu_and_one_thread_each():
    topology = read_topology(sysfs_root("vm-p100"))
    plan = plan_workers(["cpu:0", "cpu:1"], read_gpus(FakeNvml([])), topology, allowed_cpus=[0, 1])
    assert [(w.name, w.cpus, w.torch_threads, w.env) for w in plan.workers] == [
        ("cpu:0", [0], 1, {}), ("cpu:1", [1], 1, {})]
    assert plan.other_cpus == [0, 1]
    assert plan.notes == ["process affinity limits gpushare to CPUs 0-1", SHARED_NOTE]


def test_explicit_list_keeps_its_order_and_resolves_indices_and_uuids():
    report, topology = h100_node()
    plan = plan_workers(["cuda:4", H100_UUIDS[0], "cpu:8-9", "cpu"], report, topology)
    assert [w.name for w in plan.workers] == ["cuda:4", "cuda:0", "cpu:8-9", "cpu"]
    gpu4, gpu0, exact, rest = plan.workers
    assert gpu4.env == {"CUDA_VISIBLE_DEVICES": H100_UUIDS[4]} and gpu0.env == {"CUDA_VISIBLE_DEVICES": H100_UUIDS[0]}
    # GPU workers keep two cores of their node (not the explicit 8-9); `cpu` gets the other cores
    assert (gpu0.cpus, gpu4.cpus) == ([0, 1], [10, 11])
    assert (exact.cpus, exact.torch_threads, exact.numa_node, exact.memory_total_bytes) == ([8, 9], 2, 1, None)
    assert (rest.cpus, rest.torch_threads, rest.numa_node, rest.env) == (r(2, 7) + r(12, 15), 10, None, {})
    assert plan.other_cpus == r(16, 31)
    assert plan.notes == ["GPU workers keep 2 cores each; the cpu worker gets the rest",
                          "cpu: its CPUs span NUMA nodes 0-1", SIBLINGS_NOTE]
    assert plan.find(H100_UUIDS[4]) is gpu4 and plan.find("cuda:0") is gpu0
    assert plan.find("cpu:8,9") is exact and plan.find("cpu") is rest
    with pytest.raises(ValueError, match=r"^cuda:1: no engine worker runs on this device \(workers: cuda:4, cuda:0"):
        plan.find("cuda:1")


def test_explicit_cpus_are_kept_off_the_gpu_workers_cores():
    report, topology = h100_node()
    plan = plan_workers(["cuda:0", "cuda:4", "cpu:12-15"], report, topology)
    assert [(w.name, w.cpus, w.torch_threads) for w in plan.workers] == [
        ("cuda:0", r(0, 7), 8), ("cuda:4", r(8, 11), 4), ("cpu:12-15", r(12, 15), 4)]
    assert plan.other_cpus == r(16, 31) and plan.notes == [SIBLINGS_NOTE]


def test_mig_instances_by_uuid_and_a_whole_gpu_with_mig_on_is_refused():
    mig = h100_with_mig()
    report = read_gpus(FakeNvml([mig] + h100_node_gpus()[4:5]))
    topology = read_topology(sysfs_root("xeon-2s-4xh100"))
    plan = plan_workers([mig.migs[1].uuid, "cuda:1"], report, topology)
    assert [w.name for w in plan.workers] == [mig.migs[1].uuid, "cuda:1"]
    assert plan.workers[0].memory_total_bytes == 40448 * MIB and plan.workers[0].gpu_uuid == mig.uuid
    assert plan.find(mig.migs[1].uuid) is plan.workers[0]
    with pytest.raises(ValueError) as refused:
        plan_workers(["cuda:0"], report, topology)
    assert str(refused.value) == (
        f"engine.devices: cuda:0: MIG is on for GPU 0 ({mig.uuid}); name its MIG instances instead "
        f"({mig.migs[0].uuid}, {mig.migs[1].uuid})")


def test_unknown_duplicate_and_impossible_entries_are_refused_by_name():
    report, topology = h100_node()
    with pytest.raises(ValueError) as unknown:
        plan_workers(["cuda:8"], report, topology)
    assert str(unknown.value).startswith(
        f"engine.devices: cuda:8: no such device; NVML sees cuda:0 ({H100_UUIDS[0]}), cuda:1 ({H100_UUIDS[1]}), ")
    with pytest.raises(ValueError, match=r"^engine.devices: MIG-GPU-4200ccc0-2667-d4cb-9137-f932c716232a/7/0: no such"):
        plan_workers([f"MIG-{A100_UUID}/7/0"], report, topology)
    with pytest.raises(ValueError, match=rf"^engine.devices: cuda:2 and {H100_UUIDS[2]} are the same device"):
        plan_workers(["cuda:2", H100_UUIDS[2]], report, topology)
    with pytest.raises(ValueError, match=r"^engine.devices: cpu:0-3: CPU 2-3 is offline or outside this process"):
        plan_workers(["cpu:0-3"], report, topology, allowed_cpus=[0, 1, 16, 17])
    with pytest.raises(ValueError, match=r"^engine.devices: cpu:2-5: CPU 2-3 is in another cpu entry too"):
        plan_workers(["cpu:0-3", "cpu:2-5"], report, topology)
    with pytest.raises(ValueError, match=r"^engine.device: cuda, but there is no GPU to run on \(CPU mode: "):
        plan_workers(None, read_gpus(FakeNvml([])), topology, device="cuda")
    with pytest.raises(ValueError, match=r"^engine.devices: cuda:0: no such device; NVML sees no GPU \(CPU mode"):
        plan_workers(["cuda:0"], read_gpus(FakeNvml([])), topology)


@pytest.mark.parametrize("text", ["cuda", "cuda:x", "gpu:0", "GPU-123", "MIG-1234", "cpu:", "cpu:a-b", "CPU",
                                  "cpu:0-", "cpu:3-1", 0, None])
def test_device_syntax_errors_say_what_is_accepted(text):
    with pytest.raises(ValueError) as bad:
        parse_device(text)
    assert str(bad.value) == (f"{text!r} is not a device; expected 'cuda:N', a GPU UUID (GPU-...), "
                              "a MIG UUID (MIG-...), 'cpu' or 'cpu:CPULIST' (e.g. cpu:0-3,8)")


def test_device_syntax_accepts_every_documented_form():
    assert [(e.kind, e.index, e.cpus) for e in map(parse_device, [
        "cuda:3", H100_UUIDS[0], "MIG-1d5f8a42-6c0e-5b2a-9f31-0a7d4c2b8e61", f"MIG-{A100_UUID}/7/0", "cpu", "cpu:0-3,8",
    ])] == [("cuda", 3, None), ("gpu", None, None), ("mig", None, None), ("mig", None, None), ("cpu", None, None),
            ("cpu", None, (0, 1, 2, 3, 8))]


def test_per_node_cpu_workers_keep_to_the_process_affinity():
    topology = read_topology(sysfs_root("xeon-2s-silver4108-8ve"))
    plan = plan_workers(None, read_gpus(FakeNvml([])), topology, allowed_cpus=r(4, 11) + r(20, 27))
    assert [(w.name, w.cpus, w.numa_node) for w in plan.workers] == [("cpu:4-7", r(4, 7), 0), ("cpu:8-11", r(8, 11), 1)]
    assert plan.other_cpus == r(20, 27)
    assert plan.notes == ["process affinity limits gpushare to CPUs 4-11,20-27", SIBLINGS_NOTE]


def test_node_cpus_gives_the_cpu_workers_their_cpus():
    topology = read_topology(sysfs_root("xeon-2s-silver4108-8ve"))
    node = parse_node_settings({"cpus": "0-3"})
    plan = plan_workers(None, read_gpus(FakeNvml([])), topology, node)
    assert plan.workers == [WorkerPlan("cpu", "cpu", {}, r(0, 3), 4, 0)]  # one worker, as node.cpus says
    assert plan.notes[0] == "node.cpus overrides the automatic choice: engines run on CPUs 0-3"
    report, eight = h100_node()
    mixed = plan_workers(["cuda:0", "cpu"], report, eight, parse_node_settings({"cpus": "0-3,8-11"}))
    assert [(w.name, w.cpus) for w in mixed.workers] == [("cuda:0", [0, 1]), ("cpu", [2, 3, 8, 9, 10, 11])]
