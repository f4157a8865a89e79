"""GPU health from NVML: is a worker's GPU (a MIG instance's parent GPU) still fit to serve?

Unhealthy: the GPU is lost or gone, volatile (since the driver loaded) uncorrected ECC errors,
retired pages waiting for a reset, a failed row remap, or a critical Xid seen by `XidWatch`.
A check the device does not support (Hopper has no page retirement, consumer cards no ECC)
is recorded in `unchecked`, never counted against the GPU. Nothing here raises: a probe that
fails says why in `unchecked` and calls the GPU healthy, since it knows nothing bad of it.

    watch = XidWatch(gpu_uuids)        # once; keeps NVML initialised until close()
    watch.poll()                       # often: never blocks
    read_health(None, worker.mig_uuid or worker.gpu_uuid, watch)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Xids that a faulty program causes, with the GPU still fine (the list NVIDIA's Kubernetes
# device plugin skips): graphics engine exception, memory page fault, GPU stopped processing,
# preemptive cleanup after those, video processor exception.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68})
NO_GPU_INSTANCE = 0xFFFFFFFF  # an event's gpuInstanceId when it is not tied to one MIG instance
MAX_EVENTS_PER_POLL = 1000
# Drivers before R470: MIG-GPU-<gpu uuid>/<gpu instance>/<compute instance>
_LEGACY_MIG_RE = re.compile(r"^MIG-(GPU-[0-9a-fA-F-]+)/(\d+)/\d+$")


@dataclass
class DeviceHealth:
    healthy: bool
    reasons: list[str]  # why not healthy, one line each
    unchecked: list[str] = field(default_factory=list)  # checks that could not be made, and why


@dataclass
class XidEvent:
    gpu_uuid: str
    xid: int
    gpu_instance_id: int | None  # the MIG GPU instance it hit; None: the whole GPU


class XidWatch:
    """Critical Xid events of some GPUs, read without blocking (nvmlEventSetWait, timeout 0)."""

    def __init__(self, gpu_uuids: list[str], nvml=None):
        self.nvml = nvml
        self.events: list[XidEvent] = []
        self.unchecked: list[str] = []
        self.event_set = None
        self._initialised = False
        if self.nvml is None:
            try:
                import pynvml as nvml_module
            except ImportError as exc:
                self.unchecked.append(f"Xid events: the NVML bindings are not installed ({exc})")
                return
            self.nvml = nvml_module
        try:
            self.nvml.nvmlInit()
            self._initialised = True
            self.event_set = self.nvml.nvmlEventSetCreate()
        except self.nvml.NVMLError as exc:
            self.unchecked.append(f"Xid events: {exc}")
            return
        for uuid in gpu_uuids:
            try:
                handle = self.nvml.nvmlDeviceGetHandleByUUID(uuid)
                self.nvml.nvmlDeviceRegisterEvents(handle, self.nvml.nvmlEventTypeXidCriticalError, self.event_set)
            except self.nvml.NVMLError as exc:
                self.unchecked.append(f"Xid events of {uuid}: {exc}")

    def poll(self) -> list[XidEvent]:
        """The critical, non-application Xids that arrived since the last poll (also kept in events)."""
        new: list[XidEvent] = []
        if self.event_set is None:
            return new
        for _ in range(MAX_EVENTS_PER_POLL):
            try:
                data = self.nvml.nvmlEventSetWait(self.event_set, 0)
                xid = int(data.eventData)
                uuid = _text(self.nvml.nvmlDeviceGetUUID(data.device))
            except self.nvml.NVMLError:  # TIMEOUT: nothing more queued (or NVML broke: nothing to read)
                break
            instance = getattr(data, "gpuInstanceId", NO_GPU_INSTANCE)
            if xid not in APPLICATION_XIDS:
                new.append(XidEvent(uuid, xid, None if instance == NO_GPU_INSTANCE else int(instance)))
        self.events += new
        return new

    def reasons(self, gpu_uuid: str, gpu_instance_id: int | None = None) -> list[str]:
        """Xids of this GPU; for a MIG instance, those of its GPU instance or of the whole GPU."""
        return [f"Xid {event.xid} on {gpu_uuid}" for event in self.events
                if event.gpu_uuid == gpu_uuid and (gpu_instance_id is None or event.gpu_instance_id is None
                                                   or event.gpu_instance_id == gpu_instance_id)]

    def close(self) -> None:
        if self.event_set is not None:
            try:
                self.nvml.nvmlEventSetFree(self.event_set)
            except self.nvml.NVMLError:
                pass
            self.event_set = None
        if self._initialised:
            _shutdown(self.nvml)
            self._initialised = False


def read_health(nvml, uuid: str, xids: XidWatch | None = None) -> DeviceHealth:
    """Health of the GPU behind `uuid` (GPU-... or MIG-...); nvml None: import pynvml."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError as exc:
            return DeviceHealth(True, [], [f"the NVML bindings are not installed ({exc})"])
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return DeviceHealth(True, [], [f"NVML is not available ({exc})"])
    try:
        return _read_health(nvml, uuid, xids)
    except Exception as exc:  # a health probe must never take its caller down
        return DeviceHealth(True, [], [f"the health check failed: {type(exc).__name__}: {exc}"])
    finally:
        _shutdown(nvml)


def _read_health(nvml, uuid: str, xids: XidWatch | None) -> DeviceHealth:
    gpu_uuid, instance, handle, lost = _gpu_of(nvml, uuid)
    if lost:
        return DeviceHealth(False, [lost])
    reasons, unchecked = [], []

    def query(what: str, function, *args):
        try:
            return function(handle, *args)
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) == nvml.NVML_ERROR_GPU_IS_LOST:
                reasons.append(f"{gpu_uuid}: {exc}")
            else:
                unchecked.append(f"{what}: {exc}")
            return None

    ecc = query("ECC errors", nvml.nvmlDeviceGetTotalEccErrors,
                nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
    if ecc:
        reasons.append(f"{ecc} uncorrected ECC error(s) on {gpu_uuid} since the driver loaded")
    pending = query("retired pages", nvml.nvmlDeviceGetRetiredPagesPendingStatus)
    if pending == nvml.NVML_FEATURE_ENABLED:
        reasons.append(f"retired pages are pending on {gpu_uuid}: the GPU needs a reset")
    rows = query("remapped rows", nvml.nvmlDeviceGetRemappedRows)
    if rows is not None and rows[3]:
        reasons.append(f"row remapping failed on {gpu_uuid}: the GPU needs service")
    if xids is not None:
        reasons += xids.reasons(gpu_uuid, instance)
    return DeviceHealth(not reasons, list(dict.fromkeys(reasons)), unchecked)


def _gpu_of(nvml, uuid: str):
    """-> (GPU uuid, MIG GPU instance id or None, GPU handle, why it is lost or None)."""
    legacy = _LEGACY_MIG_RE.match(uuid)
    gpu_uuid, instance = (legacy.group(1), int(legacy.group(2))) if legacy else (uuid, None)
    try:
        if uuid.startswith("MIG-") and not legacy:
            mig = nvml.nvmlDeviceGetHandleByUUID(uuid)
            instance = nvml.nvmlDeviceGetGpuInstanceId(mig)
            handle = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
            gpu_uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        else:
            handle = nvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
    except nvml.NVMLError as exc:
        code = getattr(exc, "value", None)
        if code in (nvml.NVML_ERROR_NOT_FOUND, nvml.NVML_ERROR_GPU_IS_LOST):
            return gpu_uuid, instance, None, f"{uuid}: {exc}"
        raise
    return gpu_uuid, instance, handle, None


def _shutdown(nvml) -> None:
    try:
        nvml.nvmlShutdown()
    except nvml.NVMLError:
        pass


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
