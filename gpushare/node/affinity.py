"""CPU pinning plan: which CPUs each engine thread (and its torch threads) runs on, and
where HTTP and tokenisation threads go.

Each engine (one per GPU, per MIG instance, or the one CPU engine) gets physical P-cores
local to its GPU: one thread per core, never an SMT sibling or an E-core. Engines that
share a locality split its cores, whole L3 domains (AMD CCDs) first so two engines do not
share a cache. HTTP and tokenisation get what is left: E-cores and other nodes' cores
first, then SMT siblings of engine cores, and only if nothing else exists the engine cores.
`node.cpus` in the config replaces the automatic choice of engine CPUs.

How the daemon applies it (affinity is per thread and inherited by threads created later;
torch's intra-op pool takes the affinity of the thread that starts it, so pin first):

    report = read_gpus()                                   # gpushare.node.gpu
    plan = plan_pinning(read_topology("/"), settings.node, engines=engine_targets(report),
                        allowed_cpus=sorted(os.sched_getaffinity(0)))
    apply_thread_affinity(plan.other_cpus)   # main thread, before HTTP and tokeniser threads start
    # first thing in each engine thread (or MIG worker process), before any torch call:
    apply_thread_affinity(mine.cpus); torch.set_num_threads(mine.torch_threads)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from gpushare.node.node_settings import NodeSettings
from gpushare.node.topology import Core, Topology, format_cpulist


SIBLINGS_NOTE = "no spare core: HTTP and tokenisation run on the SMT siblings of engine cores"
SHARED_NOTE = "no spare CPU: HTTP and tokenisation share the engine cores"
AFFINITY_NOTE = "process affinity limits gpushare to CPUs {}"


@dataclass(frozen=True)
class EngineTarget:
    """What one engine drives: the CPU (no bus id), a GPU or a MIG instance (its GPU's bus id)."""

    name: str  # "cpu", "GPU-<uuid>" or "MIG-<uuid>"
    pci_bus_id: str | None = None


@dataclass
class EnginePinning:
    engine: str
    cpus: list[int]
    torch_threads: int
    numa_node: int | None


@dataclass
class PinningPlan:
    engines: list[EnginePinning]
    other_cpus: list[int]  # HTTP, tokenisation, everything that is not an engine
    notes: list[str] = field(default_factory=list)

    def engine(self, name: str) -> EnginePinning:
        return next(e for e in self.engines if e.engine == name)


def apply_thread_affinity(cpus: list[int]) -> None:
    """Pin the calling thread (pid 0 means "this thread" to sched_setaffinity on Linux)."""
    os.sched_setaffinity(0, cpus)


def plan_pinning(
    topology: Topology,
    settings: NodeSettings | None = None,
    engines: list[EngineTarget] | None = None,
    allowed_cpus: list[int] | None = None,
) -> PinningPlan:
    """allowed_cpus: the process's affinity (os.sched_getaffinity) when planning for this machine."""
    notes: list[str] = []
    targets = list(engines) if engines else [EngineTarget("cpu")]
    allowed = list(topology.cpus)
    if allowed_cpus is not None:
        allowed = sorted(set(topology.cpus) & set(allowed_cpus))
        if not allowed:
            raise ValueError(f"no online CPU is in this process's affinity ({format_cpulist(allowed_cpus)})")
        if len(allowed) < len(topology.cpus):
            notes.append(AFFINITY_NOTE.format(format_cpulist(allowed)))
    if settings is not None and settings.cpus is not None:
        return _plan_from_override(topology, settings.cpus, targets, allowed, notes)

    if not topology.kinds_known:
        notes.append("no hybrid information in sysfs (no cpu_core/cpu_atom, no cpufreq): all cores treated as P-cores")
    if not topology.numa_nodes and any(t.pci_bus_id for t in targets):
        notes.append("no NUMA information in sysfs: every GPU treated as local to all CPUs")
    usable = {core.cpus[0]: thread for core in topology.cores if (thread := _first_allowed(core, allowed)) is not None}
    p_cores = [core for core in topology.cores if core.kind == "P" and core.cpus[0] in usable]

    groups: dict[tuple[int, ...], list[EngineTarget]] = {}
    for target in targets:
        groups.setdefault(tuple(_local_cpus(topology, target, allowed, notes)), []).append(target)
    pinned: dict[str, list[int]] = {}
    taken: set[int] = set()
    # Most constrained locality first, so a GPU without locality cannot take node-local cores.
    for local, members in sorted(groups.items(), key=lambda item: (len(item[0]), item[0])):
        local_set = set(local)
        candidates = [c for c in p_cores if usable[c.cpus[0]] in local_set and c.cpus[0] not in taken]
        if not candidates:
            candidates = [c for c in p_cores if c.cpus[0] not in taken]
            if candidates:
                notes.append(f"{_names(members)}: no free P-core local to the GPU; using P-cores elsewhere")
        if not candidates and p_cores:
            candidates = p_cores
            notes.append(f"{_names(members)}: every P-core is taken; sharing cores with other engines")
        if not candidates:
            candidates = [c for c in topology.cores if c.cpus[0] in usable]
            notes.append(f"{_names(members)}: no P-core among the allowed CPUs; using E-cores")
        for target, cores in zip(members, _split(candidates, len(members), notes, members)):
            taken.update(c.cpus[0] for c in cores)
            pinned[target.name] = sorted(usable[c.cpus[0]] for c in cores)

    plan = [_pinning(topology, t.name, pinned[t.name]) for t in targets]
    for engine in plan:
        nodes = sorted({node for node, cpus in topology.numa_nodes.items() if set(engine.cpus) & set(cpus)})
        if len(nodes) > 1:
            notes.append(f"{engine.engine}: its CPUs span NUMA nodes {format_cpulist(nodes)}")
    return PinningPlan(plan, spare_cpus(topology, allowed, {cpu for e in plan for cpu in e.cpus}, notes), notes)


def spare_cpus(topology: Topology, allowed: list[int], engine_cpus: set[int], notes: list[str]) -> list[int]:
    """CPUs for HTTP and tokenisation: cores no engine uses, else the SMT siblings of engine
    cores, else (nothing else exists) the engine cores themselves."""
    busy_cores = {topology.core_of(cpu).cpus[0] for cpu in engine_cpus}
    other = [c for c in allowed if c not in engine_cpus and topology.core_of(c).cpus[0] not in busy_cores]
    if not other:
        other = [c for c in allowed if c not in engine_cpus]
        if other:
            notes.append(SIBLINGS_NOTE)
    if not other:
        other = list(allowed)
        notes.append(SHARED_NOTE)
    return other


def _plan_from_override(topology, cpus, targets, allowed, notes) -> PinningPlan:
    missing = sorted(set(cpus) - set(topology.cpus))
    if missing:
        raise ValueError(f"node.cpus: CPU {format_cpulist(missing)} is not online "
                         f"(online: {format_cpulist(topology.cpus)})")
    outside = sorted(set(cpus) - set(allowed))
    if outside:
        raise ValueError(f"node.cpus: CPU {format_cpulist(outside)} is outside this process's affinity "
                         f"({format_cpulist(allowed)})")
    notes.append(f"node.cpus overrides the automatic choice: engines run on CPUs {format_cpulist(cpus)}")
    chunks = _split(sorted(cpus), len(targets), notes, targets)
    plan = [_pinning(topology, target.name, sorted(chunk)) for target, chunk in zip(targets, chunks)]
    other = [c for c in allowed if c not in set(cpus)]
    if not other:
        other = list(allowed)
        notes.append("node.cpus takes every CPU: HTTP and tokenisation share them")
    return PinningPlan(plan, other, notes)


def _pinning(topology: Topology, name: str, cpus: list[int]) -> EnginePinning:
    return EnginePinning(name, cpus, len(cpus), topology.numa_node_of(cpus))


def _first_allowed(core: Core, allowed: list[int]) -> int | None:
    return next((cpu for cpu in core.cpus if cpu in allowed), None)


def _names(targets: list[EngineTarget]) -> str:
    return ", ".join(t.name for t in targets)


def _local_cpus(topology: Topology, target: EngineTarget, allowed: list[int], notes: list[str]) -> list[int]:
    if target.pci_bus_id is None:
        return allowed
    device = topology.pci_device(target.pci_bus_id)
    if device is None:
        notes.append(f"{target.name}: PCI device {target.pci_bus_id} not found in sysfs; treated as local to all CPUs")
        return allowed
    local = device.local_cpus
    if local is None and device.numa_node in topology.numa_nodes:
        local = topology.numa_nodes[device.numa_node]
    if local is None:
        notes.append(f"{target.name}: sysfs gives no locality for {device.bus_id}; treated as local to all CPUs")
        return allowed
    if device.numa_node is None and len(topology.numa_nodes) > 1:
        notes.append(f"{target.name}: sysfs gives no NUMA node for {device.bus_id} (numa_node -1 or missing); "
                     f"using its local CPUs {format_cpulist(local)}")
    local = [cpu for cpu in local if cpu in allowed]
    if not local:
        notes.append(f"{target.name}: no allowed CPU is local to {device.bus_id}; using all allowed CPUs")
        return allowed
    return local


def _split(items: list, parts: int, notes: list[str], targets: list[EngineTarget]) -> list[list]:
    """Split cores (or CPUs) among `parts` engines: whole L3 domains where there are enough,
    else contiguous runs; engines share round robin when there are fewer items than engines."""
    if parts == 1:
        return [list(items)]
    if len(items) < parts:
        notes.append(f"{_names(targets)}: {len(items)} core(s) for {parts} engines; engines share cores")
        return [[items[i % len(items)]] for i in range(parts)]
    if items and isinstance(items[0], Core):
        domains: list[list[Core]] = []
        for core in sorted(items, key=lambda c: (c.l3 is None, c.l3 or 0, c.cpus[0])):
            if domains and domains[-1][0].l3 == core.l3:
                domains[-1].append(core)
            else:
                domains.append([core])
        if len(domains) >= parts and domains[0][0].l3 is not None:
            return [[core for domain in chunk for core in domain] for chunk in _even_chunks(domains, parts)]
    return _even_chunks(list(items), parts)


def _even_chunks(items: list, parts: int) -> list[list]:
    size, extra = divmod(len(items), parts)
    chunks, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        chunks.append(items[start:end])
        start = end
    return chunks
