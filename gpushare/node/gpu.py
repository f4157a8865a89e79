"""Every NVML call gpushare makes (`import pynvml`, package nvidia-ml-py), in one place.

`read_gpus()` lists the NVIDIA GPUs: name, UUID, PCI bus id, memory, compute capability,
compute mode, MIG mode and MIG devices, running processes and utilisation. Without NVML
(no driver, no library) the report says CPU mode and why; it never raises. Tests pass a
fake module with pynvml's function names built from real nvidia-smi captures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpushare.node.affinity import EngineTarget

_COMPUTE_MODES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}


@dataclass
class MigDevice:
    index: int
    uuid: str
    profile: str | None  # "3g.40gb", from the device name NVML gives
    gpu_instance_id: int | None
    compute_instance_id: int | None
    memory_total_bytes: int | None
    memory_free_bytes: int | None = None  # at the time of reading: other processes' use counts


@dataclass
class GpuProcess:
    pid: int
    used_memory_bytes: int | None


@dataclass
class Gpu:
    index: int
    name: str
    uuid: str
    pci_bus_id: str  # NVML form, 00000000:3B:00.0
    memory_total_bytes: int
    memory_used_bytes: int
    compute_capability: tuple[int, int] | None
    compute_mode: str | None
    mig_enabled: bool | None  # None: this GPU has no MIG
    mig_pending: bool | None
    mig_devices: list[MigDevice] = field(default_factory=list)
    processes: list[GpuProcess] = field(default_factory=list)
    utilization_percent: int | None = None  # NVML does not report it while MIG is on
    memory_free_bytes: int | None = None  # NVML's, at the time of reading: what every process leaves


@dataclass
class NvmlReport:
    available: bool
    reason: str  # why CPU mode, or a one-line summary
    driver_version: str | None = None
    gpus: list[Gpu] = field(default_factory=list)

    @property
    def cpu_mode(self) -> bool:
        return not self.gpus


def read_gpus(nvml=None) -> NvmlReport:
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError as exc:
            return NvmlReport(False, f"CPU mode: the NVML bindings are not installed ({exc})")
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return NvmlReport(False, f"CPU mode: NVML is not available ({exc}); no NVIDIA driver on this machine")
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        gpus = [_read_gpu(nvml, index) for index in range(nvml.nvmlDeviceGetCount())]
    except nvml.NVMLError as exc:
        return NvmlReport(False, f"CPU mode: NVML failed while listing GPUs ({exc})")
    finally:
        nvml.nvmlShutdown()
    if not gpus:
        return NvmlReport(True, f"CPU mode: NVIDIA driver {driver} sees no GPU", driver)
    return NvmlReport(True, f"{len(gpus)} GPU(s), NVIDIA driver {driver}", driver, gpus)


def compute_devices(report: NvmlReport) -> list[tuple[Gpu, MigDevice | None]]:
    """What can run an engine: each GPU, or each MIG instance (with its GPU) where MIG is on.
    A MIG-enabled GPU without instances can run nothing, so it is not listed."""
    devices: list[tuple[Gpu, MigDevice | None]] = []
    for gpu in report.gpus:
        if gpu.mig_enabled:
            devices += [(gpu, mig) for mig in gpu.mig_devices]
        else:
            devices.append((gpu, None))
    return devices


def engine_targets(report: NvmlReport) -> list[EngineTarget]:
    """One engine per GPU, or per MIG instance where MIG is on; [] means the CPU engine."""
    return [EngineTarget(mig.uuid if mig else gpu.uuid, gpu.pci_bus_id) for gpu, mig in compute_devices(report)]


def _read_gpu(nvml, index: int) -> Gpu:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    mig_modes = _optional(nvml, nvml.nvmlDeviceGetMigMode, handle)
    mig_enabled = None if mig_modes is None else mig_modes[0] == nvml.NVML_DEVICE_MIG_ENABLE
    utilization = _optional(nvml, nvml.nvmlDeviceGetUtilizationRates, handle)
    capability = _optional(nvml, nvml.nvmlDeviceGetCudaComputeCapability, handle)
    mode = _optional(nvml, nvml.nvmlDeviceGetComputeMode, handle)
    processes = _optional(nvml, nvml.nvmlDeviceGetComputeRunningProcesses, handle) or []
    return Gpu(
        index=index,
        name=_text(nvml.nvmlDeviceGetName(handle)),
        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
        pci_bus_id=_text(nvml.nvmlDeviceGetPciInfo(handle).busId),
        memory_total_bytes=int(memory.total),
        memory_used_bytes=int(memory.used),
        memory_free_bytes=int(memory.free),
        compute_capability=tuple(capability) if capability is not None else None,
        compute_mode=_COMPUTE_MODES.get(mode) if mode is not None else None,
        mig_enabled=mig_enabled,
        mig_pending=None if mig_modes is None else mig_modes[1] == nvml.NVML_DEVICE_MIG_ENABLE,
        mig_devices=_read_mig_devices(nvml, handle) if mig_enabled else [],
        processes=[GpuProcess(int(p.pid), p.usedGpuMemory) for p in processes],
        utilization_percent=None if utilization is None else int(utilization.gpu),
    )


def _read_mig_devices(nvml, handle) -> list[MigDevice]:
    devices = []
    for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        mig = _optional(nvml, nvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, slot)
        if mig is None:  # an empty slot
            continue
        name = _text(nvml.nvmlDeviceGetName(mig))  # "NVIDIA H100 80GB HBM3 MIG 3g.40gb"
        memory = _optional(nvml, nvml.nvmlDeviceGetMemoryInfo, mig)
        devices.append(MigDevice(
            index=len(devices),
            uuid=_text(nvml.nvmlDeviceGetUUID(mig)),
            profile=name.rsplit("MIG ", 1)[1].strip() if "MIG " in name else None,
            gpu_instance_id=_optional(nvml, nvml.nvmlDeviceGetGpuInstanceId, mig),
            compute_instance_id=_optional(nvml, nvml.nvmlDeviceGetComputeInstanceId, mig),
            memory_total_bytes=None if memory is None else int(memory.total),
            memory_free_bytes=None if memory is None else int(memory.free),
        ))
    return devices


def _optional(nvml, function, *args):
    """Queries some GPUs or modes do not support (MIG on a consumer card, utilisation under MIG)."""
    try:
        return function(*args)
    except nvml.NVMLError:
        return None


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
