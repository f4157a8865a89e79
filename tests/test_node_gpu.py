"""GPUs through NVML: a pynvml stand-in with values from real captures; no NVML means CPU mode."""

import sys
from pathlib import Path

import pynvml

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "node"))
from node_fakes import XEON_GPUS, FakeNvml, h100_with_mig  # noqa: E402

from gpushare.node.affinity import EngineTarget  # noqa: E402
from gpushare.node.gpu import GpuProcess, MigDevice, engine_targets, read_gpus  # noqa: E402


def test_four_h100_from_the_8xh100_capture():
    nvml = FakeNvml(XEON_GPUS)
    report = read_gpus(nvml)
    assert report.available and not report.cpu_mode
    assert report.reason == "4 GPU(s), NVIDIA driver 565.57.01"
    first = report.gpus[0]
    assert (first.index, first.name, first.uuid, first.pci_bus_id) == (
        0, "NVIDIA H100 80GB HBM3", "GPU-b42dd28e-ffdd-8720-1df0-98bd8cdc05b1", "00000000:18:00.0")
    assert (first.memory_total_bytes, first.memory_used_bytes) == (81559 * 2**20, 2**20)
    assert (first.compute_capability, first.compute_mode) == ((9, 0), "Default")
    assert (first.mig_enabled, first.mig_pending) == (False, False)
    assert (first.mig_devices, first.processes, first.utilization_percent) == ([], [], 0)
    assert not nvml.initialised  # shut down again
    assert engine_targets(report) == [EngineTarget(g.uuid, g.bus_id) for g in XEON_GPUS]


def test_mig_devices_become_engines():
    gpu = h100_with_mig()
    gpu.processes = [(3805, 326)]
    report = read_gpus(FakeNvml([gpu], driver="580.65.06"))
    [h100] = report.gpus
    assert h100.mig_enabled and h100.utilization_percent is None  # NVML has no utilisation under MIG
    assert h100.mig_devices == [
        MigDevice(0, "MIG-1d5f8a42-6c0e-5b2a-9f31-0a7d4c2b8e61", "3g.40gb", 1, 0, 40448 * 2**20, 40448 * 2**20),
        MigDevice(1, "MIG-84b3c6e0-2f9d-5a17-b8c4-93e1f0d27a55", "3g.40gb", 2, 0, 40448 * 2**20, 40448 * 2**20),
    ]
    assert h100.processes == [GpuProcess(3805, 326 * 2**20)]
    assert engine_targets(report) == [EngineTarget(m.uuid, "00000000:42:00.0") for m in h100.mig_devices]
    gpu.migs = []  # MIG on without instances: nothing can run there
    assert engine_targets(read_gpus(FakeNvml([gpu]))) == []


def test_no_driver_is_cpu_mode_not_a_crash():
    for code, words in ((pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "NVML Shared Library Not Found"),
                        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded")):
        report = read_gpus(FakeNvml(XEON_GPUS, init_error=code))
        assert not report.available and report.cpu_mode and report.gpus == []
        assert report.reason == f"CPU mode: NVML is not available ({words}); no NVIDIA driver on this machine"
        assert engine_targets(report) == []
    empty = read_gpus(FakeNvml([]))
    assert empty.available and empty.cpu_mode and empty.reason == "CPU mode: NVIDIA driver 565.57.01 sees no GPU"


def test_this_machine_through_the_real_pynvml():
    report = read_gpus()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:  # no driver here: the report must say CPU mode and why
        assert report.cpu_mode and not report.available
        assert report.reason.startswith("CPU mode: NVML is not available") and str(exc) in report.reason
        return
    count = pynvml.nvmlDeviceGetCount()
    pynvml.nvmlShutdown()
    assert report.available and len(report.gpus) == count
