"""Engine worker plan: which devices get an engine worker process, and how each is started.

One worker per device: a whole GPU, a MIG instance, or a set of CPUs. `engine.devices`
says which (`auto`, or a list of `cuda:N`, `GPU-<uuid>`, `MIG-<uuid>`, `cpu`, `cpu:CPULIST`);
`plan_workers` turns it, with what NVML and sysfs report, into one `WorkerPlan` each: its
environment (CUDA_VISIBLE_DEVICES=<uuid>, so inside the worker its GPU is always cuda:0;
the MPS client variables when node.mps is enabled), its CPUs and torch threads.

`cuda:N` is NVML's (nvidia-smi's) index N, which is PCI bus order; CUDA itself numbers by
speed unless CUDA_DEVICE_ORDER=PCI_BUS_ID, which is why workers are given UUIDs, never indices.

How the daemon uses it:

    plan = plan_workers(settings.engine.devices, read_gpus(), read_topology("/"), settings.node,
                        sorted(os.sched_getaffinity(0)), settings.engine.device)
    apply_thread_affinity(plan.other_cpus)              # the supervisor: HTTP, tokenisation
    for worker in plan.workers:                         # each in its own process:
        env = os.environ | worker.env                   # before the child imports torch
        # in the child: apply_thread_affinity(worker.cpus); torch.set_num_threads(worker.torch_threads)
    worker = plan.find(model.device)                    # models[].device -> its worker
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gpushare.node.affinity import (AFFINITY_NOTE, SHARED_NOTE, SIBLINGS_NOTE, EngineTarget, plan_pinning,
                                    spare_cpus)
from gpushare.node.gpu import Gpu, MigDevice, NvmlReport, compute_devices
from gpushare.node.mps import MpsTarget
from gpushare.node.node_settings import NodeSettings
from gpushare.node.topology import Topology, format_cpulist, parse_cpulist

ACCEPTED = "'cuda:N', a GPU UUID (GPU-...), a MIG UUID (MIG-...), 'cpu' or 'cpu:CPULIST' (e.g. cpu:0-3,8)"
_UUID = r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
# With a plain `cpu` entry beside GPUs, each GPU worker keeps this many of its cores and the CPU
# worker gets the rest: a GPU worker's threads mostly launch kernels and wait.
GPU_WORKER_CORES_BESIDE_CPU = 2
_CUDA_RE = re.compile(r"^cuda:(\d+)$")
_CPULIST_RE = re.compile(r"^cpu:(\d+(-\d+)?(,\d+(-\d+)?)*)$")
_GPU_RE = re.compile(rf"^GPU-{_UUID}$")
# Drivers before R470 name MIG devices MIG-GPU-<gpu uuid>/<gpu instance>/<compute instance>.
_MIG_RE = re.compile(rf"^MIG-({_UUID}|GPU-{_UUID}/\d+/\d+)$")


@dataclass(frozen=True)
class DeviceEntry:
    """One item of engine.devices (or a models[].device), checked for syntax only."""

    text: str
    kind: str  # "cuda" (by index), "gpu" (by UUID), "mig" (by UUID) or "cpu"
    index: int | None = None  # cuda:N
    cpus: tuple[int, ...] | None = None  # cpu:CPULIST; None for plain "cpu"


def parse_device(text) -> DeviceEntry:
    """ValueError (without the key: the caller names it) when `text` is none of ACCEPTED."""
    if isinstance(text, str):
        if match := _CUDA_RE.match(text):
            return DeviceEntry(text, "cuda", index=int(match.group(1)))
        if _GPU_RE.match(text):
            return DeviceEntry(text, "gpu")
        if _MIG_RE.match(text):
            return DeviceEntry(text, "mig")
        if text == "cpu":
            return DeviceEntry(text, "cpu")
        if (match := _CPULIST_RE.match(text)) and (cpus := parse_cpulist(match.group(1))):  # "cpu:3-1" is empty
            return DeviceEntry(text, "cpu", cpus=tuple(cpus))
    raise ValueError(f"{text!r} is not a device; expected {ACCEPTED}")


@dataclass
class WorkerPlan:
    name: str  # "cuda:0", "MIG-<uuid>", "cpu" or "cpu:0-3": stable, for logs, metrics and the API
    torch_device: str  # "cuda" (its one visible GPU is cuda:0) or "cpu"
    env: dict[str, str]  # set in the worker's environment before it imports torch
    cpus: list[int]
    torch_threads: int
    numa_node: int | None
    gpu_uuid: str | None = None  # the physical GPU (a MIG instance's parent), for health checks
    mig_uuid: str | None = None
    gpu_index: int | None = None  # NVML index of gpu_uuid
    memory_total_bytes: int | None = None  # the GPU's or MIG instance's memory; None on the CPU
    memory_free_bytes: int | None = None  # of that, what was free when planned (other processes hold the rest)


@dataclass
class WorkerPlanSet:
    workers: list[WorkerPlan]
    other_cpus: list[int]  # the supervisor: HTTP, tokenisation
    notes: list[str] = field(default_factory=list)

    def find(self, text: str) -> WorkerPlan:
        """The worker running on a device named any way engine.devices accepts (models[].device)."""
        entry = parse_device(text)
        found = [w for w in self.workers if _matches(entry, w)]
        if entry.kind == "cpu" and entry.cpus is None and len(found) > 1:
            found = [w for w in found if w.name == "cpu"]
        if len(found) != 1:
            raise ValueError(f"{text}: no engine worker runs on this device "
                             f"(workers: {', '.join(w.name for w in self.workers)})")
        return found[0]

    def memory_total_bytes(self) -> dict[str, int]:
        """Each GPU or MIG worker's device memory (NVML's), by worker name."""
        return {w.name: w.memory_total_bytes for w in self.workers if w.memory_total_bytes is not None}

    def memory_free_bytes(self) -> dict[str, int]:
        """Each GPU or MIG worker's free device memory when planned (NVML's), by worker name."""
        return {w.name: w.memory_free_bytes for w in self.workers if w.memory_free_bytes is not None}


def one_process_devices(workers: list[WorkerPlan]) -> tuple[str | None, dict[str, str]]:
    """engine.isolation: thread, every worker's engine in one process: the CUDA_VISIBLE_DEVICES that
    process needs (None: no GPU among them) and each worker's torch device by name, ``cuda:K`` for
    the K-th GPU it lists, in plan order (CUDA_VISIBLE_DEVICES is read once per process, so the
    workers' own ``env`` cannot apply). ValueError for a MIG instance beside another GPU device: a
    CUDA process enumerates one MIG instance at most, so only engine.isolation: process can run both."""
    gpus = [w for w in workers if w.torch_device == "cuda"]
    migs = [w.name for w in gpus if w.mig_uuid is not None]
    if migs and len(gpus) > 1:
        raise ValueError(f"engine.isolation: thread cannot run {migs[0]} beside "
                         f"{', '.join(w.name for w in gpus if w.name != migs[0])}: a CUDA process sees one MIG "
                         f"instance at most; use engine.isolation: process (the default)")
    visible = ",".join(w.mig_uuid or w.gpu_uuid for w in gpus) or None
    return visible, {w.name: f"cuda:{gpus.index(w)}" if w in gpus else w.torch_device for w in workers}


def plan_workers(devices: list[str] | None, report: NvmlReport, topology: Topology,
                 node: NodeSettings | None = None, allowed_cpus: list[int] | None = None,
                 device: str = "auto") -> WorkerPlanSet:
    """devices: engine.devices (None: auto); device: engine.device, which only steers auto.
    allowed_cpus: the process's affinity. ValueError names the entry that cannot be planned."""
    node = node or NodeSettings()
    if devices is None:
        units = compute_devices(report)
        if device == "cuda" and not units:
            raise ValueError(f"engine.device: cuda, but there is no GPU to run on ({report.reason})")
        if device == "cpu" or not units:
            return _auto_cpu(topology, node, allowed_cpus)
        return _plan(list(enumerate(units)), [], topology, node, allowed_cpus)
    entries = list(enumerate(parse_device(text) for text in devices))
    units, seen = [], {}
    for position, entry in entries:
        if entry.kind == "cpu":
            continue
        gpu, mig = _resolve(entry, report)
        uuid = mig.uuid if mig else gpu.uuid
        if uuid in seen:
            raise ValueError(f"engine.devices: {seen[uuid]} and {entry.text} are the same device ({uuid})")
        seen[uuid] = entry.text
        units.append((position, (gpu, mig)))
    return _plan(units, [(i, e) for i, e in entries if e.kind == "cpu"], topology, node, allowed_cpus)


def _plan(units, cpu_entries: list[tuple[int, DeviceEntry]], topology: Topology, node: NodeSettings,
          allowed_cpus: list[int] | None) -> WorkerPlanSet:
    """units and cpu_entries carry their position in engine.devices, the order of the workers."""
    notes: list[str] = []
    allowed = _allowed(topology, allowed_cpus, notes)
    workers: list[tuple[int, WorkerPlan]] = []
    reserved: set[int] = set()
    for position, entry in cpu_entries:
        if entry.cpus is None:
            continue
        outside = sorted(set(entry.cpus) - set(allowed))
        if outside:
            raise ValueError(f"engine.devices: {entry.text}: CPU {format_cpulist(outside)} is offline or outside "
                             f"this process's affinity (usable: {format_cpulist(allowed)})")
        if reserved & set(entry.cpus):
            raise ValueError(f"engine.devices: {entry.text}: CPU {format_cpulist(reserved & set(entry.cpus))} "
                             "is in another cpu entry too")
        reserved |= set(entry.cpus)
        workers.append((position, _cpu_worker(topology, f"cpu:{format_cpulist(entry.cpus)}", sorted(entry.cpus))))
    if units:
        # Whole cores: a GPU worker on the SMT sibling of an explicit CPU would share its core.
        reserved_cores = {topology.core_of(cpu).cpus[0] for cpu in reserved}
        free = ([cpu for cpu in allowed if topology.core_of(cpu).cpus[0] not in reserved_cores]
                or [cpu for cpu in allowed if cpu not in reserved])
        if not free:
            raise ValueError(f"engine.devices: the cpu entries take every usable CPU ({format_cpulist(allowed)}); "
                             "none is left for the GPU workers")
        targets = [EngineTarget(mig.uuid if mig else gpu.uuid, gpu.pci_bus_id) for _, (gpu, mig) in units]
        pinning = plan_pinning(topology, node, targets, free)
        # Affinity and HTTP CPUs are said once, below, for all workers.
        affinity_note = AFFINITY_NOTE.format(format_cpulist(free))
        notes += [note for note in pinning.notes if note not in (affinity_note, SIBLINGS_NOTE, SHARED_NOTE)]
        plain_cpu = any(entry.cpus is None for _, entry in cpu_entries)
        for (position, (gpu, mig)), target in zip(units, targets):
            engine = pinning.engine(target.name)
            if plain_cpu:
                engine.cpus = engine.cpus[:GPU_WORKER_CORES_BESIDE_CPU]
                engine.torch_threads = len(engine.cpus)
            workers.append((position, _gpu_worker(gpu, mig, engine, node)))
        if plain_cpu:
            notes.append(f"GPU workers keep {GPU_WORKER_CORES_BESIDE_CPU} cores each; the cpu worker gets the rest")
    for position, entry in cpu_entries:
        if entry.cpus is not None:
            continue
        busy = {topology.core_of(cpu).cpus[0] for _, w in workers for cpu in w.cpus}
        pool = [cpu for cpu in (node.cpus or allowed) if cpu in allowed and topology.core_of(cpu).cpus[0] not in busy]
        cpus = _one_thread_per_core(topology, pool, notes)
        if not cpus:
            raise ValueError("engine.devices: cpu: no CPU is left for it after the other entries "
                             f"(usable: {format_cpulist(allowed)})")
        workers.append((position, _cpu_worker(topology, "cpu", cpus)))
    ordered = [worker for _, worker in sorted(workers, key=lambda item: item[0])]
    for worker in ordered:
        nodes = sorted({n for n, cpus in topology.numa_nodes.items() if set(worker.cpus) & set(cpus)})
        if worker.torch_device == "cpu" and len(nodes) > 1:
            notes.append(f"{worker.name}: its CPUs span NUMA nodes {format_cpulist(nodes)}")
    engine_cpus = {cpu for worker in ordered for cpu in worker.cpus}
    return WorkerPlanSet(ordered, spare_cpus(topology, allowed, engine_cpus, notes), notes)


def _auto_cpu(topology: Topology, node: NodeSettings, allowed_cpus: list[int] | None) -> WorkerPlanSet:
    """One CPU worker per NUMA node (memory stays local to each); one in all when node.cpus is set."""
    notes: list[str] = []
    allowed = _allowed(topology, allowed_cpus, notes)
    nodes = {n: [cpu for cpu in cpus if cpu in allowed] for n, cpus in topology.numa_nodes.items()}
    nodes = {n: cpus for n, cpus in nodes.items() if cpus}
    if len(nodes) < 2 or node.cpus is not None:
        pinning = plan_pinning(topology, node, None, allowed_cpus)
        [engine] = pinning.engines
        worker = WorkerPlan("cpu", "cpu", {}, engine.cpus, engine.torch_threads, engine.numa_node)
        return WorkerPlanSet([worker], pinning.other_cpus, pinning.notes)
    workers = [_cpu_worker(topology, f"cpu:{format_cpulist(cpus)}", cpus)
               for cpus in (_one_thread_per_core(topology, members, notes) for members in nodes.values())]
    engine_cpus = {cpu for worker in workers for cpu in worker.cpus}
    return WorkerPlanSet(workers, spare_cpus(topology, allowed, engine_cpus, notes), notes)


def _allowed(topology: Topology, allowed_cpus: list[int] | None, notes: list[str]) -> list[int]:
    if allowed_cpus is None:
        return list(topology.cpus)
    allowed = sorted(set(topology.cpus) & set(allowed_cpus))
    if not allowed:
        raise ValueError(f"no online CPU is in this process's affinity ({format_cpulist(allowed_cpus)})")
    if len(allowed) < len(topology.cpus):
        notes.append(AFFINITY_NOTE.format(format_cpulist(allowed)))
    return allowed


def _one_thread_per_core(topology: Topology, pool: list[int], notes: list[str]) -> list[int]:
    """The first CPU of `pool` on each P-core (SMT siblings and E-cores are left to HTTP),
    or on every core when the pool holds no P-core."""
    chosen: dict[int, tuple[str, int]] = {}
    for cpu in sorted(pool):
        core = topology.core_of(cpu)
        chosen.setdefault(core.cpus[0], (core.kind, cpu))
    p_cpus = sorted(cpu for kind, cpu in chosen.values() if kind == "P")
    if p_cpus or not chosen:
        return p_cpus
    notes.append(f"CPUs {format_cpulist(pool)}: no P-core among them; using E-cores")
    return sorted(cpu for _, cpu in chosen.values())


def _cpu_worker(topology: Topology, name: str, cpus: list[int]) -> WorkerPlan:
    return WorkerPlan(name, "cpu", {}, cpus, len(cpus), topology.numa_node_of(cpus))


def _gpu_worker(gpu: Gpu, mig: MigDevice | None, pinning, node: NodeSettings) -> WorkerPlan:
    uuid = mig.uuid if mig else gpu.uuid
    # Also with MPS: without it, a worker whose daemon is down would fall back to seeing every GPU.
    env = {"CUDA_VISIBLE_DEVICES": uuid}
    if node.mps.enabled:
        env.update(MpsTarget(uuid, gpu.uuid, gpu.index, node.mps.root).client_env())
    return WorkerPlan(
        name=mig.uuid if mig else f"cuda:{gpu.index}", torch_device="cuda", env=env,
        cpus=pinning.cpus, torch_threads=pinning.torch_threads, numa_node=pinning.numa_node,
        gpu_uuid=gpu.uuid, mig_uuid=mig.uuid if mig else None, gpu_index=gpu.index,
        memory_total_bytes=mig.memory_total_bytes if mig else gpu.memory_total_bytes,
        memory_free_bytes=mig.memory_free_bytes if mig else gpu.memory_free_bytes,
    )


def _resolve(entry: DeviceEntry, report: NvmlReport) -> tuple[Gpu, MigDevice | None]:
    for gpu in report.gpus:
        if entry.kind == "mig":
            mig = next((m for m in gpu.mig_devices if m.uuid == entry.text), None)
            if mig is not None:
                return gpu, mig
        elif (entry.kind == "cuda" and gpu.index == entry.index) or gpu.uuid == entry.text:
            if gpu.mig_enabled:
                instances = ", ".join(m.uuid for m in gpu.mig_devices) or "none yet"
                raise ValueError(f"engine.devices: {entry.text}: MIG is on for GPU {gpu.index} ({gpu.uuid}); "
                                 f"name its MIG instances instead ({instances})")
            return gpu, None
    raise ValueError(f"engine.devices: {entry.text}: no such device; NVML sees {_seen(report)}")


def _seen(report: NvmlReport) -> str:
    if not report.gpus:
        return f"no GPU ({report.reason})"
    names = []
    for gpu in report.gpus:
        names.append(f"cuda:{gpu.index} ({gpu.uuid})")
        names += [mig.uuid for mig in gpu.mig_devices]
    return ", ".join(names)


def _matches(entry: DeviceEntry, worker: WorkerPlan) -> bool:
    if entry.kind == "cpu":
        return worker.torch_device == "cpu" and (entry.cpus is None or sorted(entry.cpus) == worker.cpus)
    if entry.kind == "mig":
        return worker.mig_uuid == entry.text
    if worker.mig_uuid is not None:
        return False
    return worker.gpu_index == entry.index if entry.kind == "cuda" else worker.gpu_uuid == entry.text
