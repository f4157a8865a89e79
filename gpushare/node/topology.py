"""CPU, NUMA and GPU locality read from sysfs.

Cores (SMT siblings from `topology/core_cpus_list`, older kernels `thread_siblings_list`),
their kind (P or E: `/sys/devices/cpu_core/cpus` and `cpu_atom/cpus`, else a clear gap in
`cpufreq/cpuinfo_max_freq`), packages, L3 domains (AMD CCDs: the `cache/index*` whose
`level` is 3), NUMA nodes, and each PCI device's `numa_node` / `local_cpulist`.
The root is a parameter so tests read fake and captured trees; "/" reads this machine.
Reading never fails on a missing file: what sysfs does not say is None, and a note says so.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

# Favoured cores (Turbo Boost Max 3.0) sit within ~5% of their siblings' max frequency;
# E-cores sit 25% or more below P-cores. A gap this wide between two frequency groups
# means two core types.
HYBRID_FREQ_GAP = 1.15
NVIDIA_VENDOR = "0x10de"
_GPU_CLASSES = ("0x0300", "0x0302")  # VGA controller, 3D controller


def parse_cpulist(text: str) -> list[int]:
    """'0-7,16-23' -> [0..7, 16..23]. Tolerates the trailing NUL some kernels write."""
    cpus: set[int] = set()
    for part in text.replace("\0", "").strip().split(","):
        part = part.strip()
        if not part:
            continue
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"not a CPU list: {text!r}")
        cpus.update(range(int(low), int(high or low) + 1))
    return sorted(cpus)


def parse_cpumask(text: str) -> list[int]:
    """'0000,00ff00ff' (32-bit hex words, most significant first) -> CPU numbers."""
    value = int("".join(text.replace("\0", "").strip().split(",")) or "0", 16)
    return [bit for bit in range(value.bit_length()) if value >> bit & 1]


def format_cpulist(cpus) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (the kernel's own notation)."""
    ordered = sorted(set(cpus))
    runs: list[str] = []
    start = 0
    for i in range(1, len(ordered) + 1):
        if i == len(ordered) or ordered[i] != ordered[i - 1] + 1:
            first, last = ordered[start], ordered[i - 1]
            runs.append(str(first) if first == last else f"{first}-{last}")
            start = i
    return ",".join(runs)


def normalize_pci_bus_id(bus_id: str) -> str:
    """NVML's '00000000:3B:00.0' (8-digit domain, upper case) -> sysfs's '0000:3b:00.0'."""
    parts = bus_id.strip().lower().split(":")
    if len(parts) == 2:
        parts.insert(0, "0")
    if len(parts) != 3 or "." not in parts[2]:
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    device, _, function = parts[2].partition(".")
    return f"{int(parts[0], 16):04x}:{int(parts[1], 16):02x}:{int(device, 16):02x}.{int(function, 16):x}"


@dataclass
class Core:
    cpus: list[int]  # the SMT siblings, lowest first
    kind: str  # "P" or "E"
    package: int | None
    numa_node: int | None
    l3: int | None  # index into Topology.l3_domains
    max_freq_khz: int | None


@dataclass
class PciDevice:
    bus_id: str  # sysfs form, 0000:3b:00.0
    vendor: str | None
    device: str | None
    pci_class: str | None
    numa_node: int | None  # None where sysfs says -1 or nothing
    local_cpus: list[int] | None  # None where sysfs has neither local_cpulist nor local_cpus


@dataclass
class Topology:
    root: Path
    cpus: list[int]  # online CPUs
    cores: list[Core]
    packages: dict[int, list[int]]
    numa_nodes: dict[int, list[int]]  # only nodes with CPUs
    l3_domains: list[list[int]]
    kind_source: str  # how P and E were told apart, in words
    kinds_known: bool  # False: sysfs said nothing about core types; all are called P
    smt_known: bool
    nvidia_gpus: list[PciDevice]
    notes: list[str] = field(default_factory=list)

    @property
    def hybrid(self) -> bool:
        return any(core.kind == "E" for core in self.cores)

    def core_of(self, cpu: int) -> Core:
        for core in self.cores:
            if cpu in core.cpus:
                return core
        raise KeyError(cpu)

    def numa_node_of(self, cpus) -> int | None:
        """The one NUMA node holding all these CPUs, or None."""
        nodes = {node for node, members in self.numa_nodes.items() if set(cpus) & set(members)}
        return nodes.pop() if len(nodes) == 1 else None

    def pci_device(self, bus_id: str) -> PciDevice | None:
        return read_pci_device(self.root, bus_id, self.cpus)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").replace("\0", "").strip()
    except OSError:  # missing, dangling symlink, permission: sysfs simply does not say
        return None


def _read_int(path: Path) -> int | None:
    text = _read(path)
    try:
        return int(text) if text else None
    except ValueError:
        return None


def _read_cpus(list_path: Path, mask_path: Path | None = None) -> list[int] | None:
    text = _read(list_path)
    if text is not None:
        return parse_cpulist(text)
    if mask_path is not None:
        mask = _read(mask_path)
        if mask is not None:
            return parse_cpumask(mask)
    return None


def read_pci_device(root: Path, bus_id: str, online: list[int]) -> PciDevice | None:
    path = Path(root) / "sys/bus/pci/devices" / normalize_pci_bus_id(bus_id)
    if not path.exists():
        return None
    numa = _read_int(path / "numa_node")
    local = _read_cpus(path / "local_cpulist", path / "local_cpus")
    if local is not None:
        local = [cpu for cpu in local if cpu in set(online)] or None
    return PciDevice(
        bus_id=path.name, vendor=_read(path / "vendor"), device=_read(path / "device"),
        pci_class=_read(path / "class"), numa_node=numa if numa is not None and numa >= 0 else None,
        local_cpus=local,
    )


def read_topology(root: str | Path = "/") -> Topology:
    root = Path(root)
    cpu_dir = root / "sys/devices/system/cpu"
    notes: list[str] = []
    cpus = _online_cpus(cpu_dir, notes)
    siblings, smt_known = _smt_siblings(cpu_dir, cpus, notes)
    l3_domains = _l3_domains(cpu_dir, cpus)
    l3_of = {cpu: i for i, domain in enumerate(l3_domains) for cpu in domain}
    numa_nodes = _numa_nodes(root, set(cpus), notes)
    node_of = {cpu: node for node, members in numa_nodes.items() for cpu in members}

    freqs = {cpu: _read_int(cpu_dir / f"cpu{cpu}" / "cpufreq" / "cpuinfo_max_freq") for cpu in cpus}
    kinds, kind_source, kinds_known = _classify_kinds(root, cpus, freqs)

    packages: dict[int, list[int]] = {}
    cores: list[Core] = []
    seen: set[int] = set()
    for cpu in cpus:
        package = _read_int(cpu_dir / f"cpu{cpu}" / "topology" / "physical_package_id")
        if package is not None:
            packages.setdefault(package, []).append(cpu)
        if cpu in seen:
            continue
        members = [c for c in siblings[cpu] if c not in seen]
        seen.update(members)
        cores.append(Core(members, kinds[cpu], package, node_of.get(cpu), l3_of.get(cpu), freqs[cpu]))

    gpus = []
    for path in sorted(_children(root / "sys/bus/pci/devices")):
        vendor, pci_class = _read(path / "vendor"), _read(path / "class") or ""
        if vendor == NVIDIA_VENDOR and pci_class.startswith(_GPU_CLASSES):
            gpus.append(read_pci_device(root, path.name, cpus))
    return Topology(root, cpus, cores, dict(sorted(packages.items())), numa_nodes, l3_domains,
                    kind_source, kinds_known, smt_known, gpus, notes)


def _online_cpus(cpu_dir: Path, notes: list[str]) -> list[int]:
    """The online CPUs that have a topology folder (all listed ones if none has: a note says so)."""
    listed = _read_cpus(cpu_dir / "online")
    if listed is None:
        listed = sorted(int(m.group(1)) for p in _children(cpu_dir) if (m := re.fullmatch(r"cpu(\d+)", p.name)))
    cpus = [cpu for cpu in listed if (cpu_dir / f"cpu{cpu}" / "topology").is_dir()]
    if not cpus:
        cpus = listed or list(range(os.cpu_count() or 1))
        notes.append(f"no CPU topology under {cpu_dir}: each CPU is treated as its own core")
    return cpus


def _smt_siblings(cpu_dir: Path, cpus: list[int], notes: list[str]) -> tuple[dict[int, list[int]], bool]:
    """Each CPU's SMT siblings among ``cpus``, itself included; whether sysfs listed any."""
    online = set(cpus)
    siblings: dict[int, list[int]] = {}
    smt_known = False
    for cpu in cpus:
        topo = cpu_dir / f"cpu{cpu}" / "topology"
        found = _read_cpus(topo / "core_cpus_list", topo / "core_cpus")
        if found is None:
            found = _read_cpus(topo / "thread_siblings_list", topo / "thread_siblings")
        smt_known |= found is not None
        siblings[cpu] = sorted((set(found or []) & online) | {cpu})
    if not smt_known:
        notes.append("no SMT sibling lists in sysfs: every CPU is treated as its own core")
    return siblings, smt_known


def _l3_domains(cpu_dir: Path, cpus: list[int]) -> list[list[int]]:
    """The sets of ``cpus`` that share a last-level (L3) cache, sorted."""
    online = set(cpus)
    domains: list[list[int]] = []
    for cpu in cpus:
        for index in sorted(_children(cpu_dir / f"cpu{cpu}" / "cache")):
            if _read(index / "level") != "3":
                continue
            shared = _read_cpus(index / "shared_cpu_list", index / "shared_cpu_map")
            domain = sorted((set(shared or []) & online) | {cpu})
            if domain not in domains:
                domains.append(domain)
    return sorted(domains)


def _numa_nodes(root: Path, online: set[int], notes: list[str]) -> dict[int, list[int]]:
    """NUMA node -> its online CPUs (empty, with a note, where sysfs has no node folders)."""
    nodes: dict[int, list[int]] = {}
    for node_dir in _children(root / "sys/devices/system/node"):
        match = re.fullmatch(r"node(\d+)", node_dir.name)
        members = _read_cpus(node_dir / "cpulist", node_dir / "cpumap") if match else None
        if members and set(members) & online:
            nodes[int(match.group(1))] = sorted(set(members) & online)
    if not nodes:
        notes.append("no NUMA information in sysfs: all CPUs are treated as one node")
    return dict(sorted(nodes.items()))


def _children(path: Path) -> list[Path]:
    try:
        return list(path.iterdir())
    except OSError:
        return []


def _classify_kinds(root: Path, cpus: list[int], freqs: dict[int, int | None]):
    """-> ({cpu: "P"|"E"}, how it was decided, whether sysfs said anything at all)."""
    p_list = _read(root / "sys/devices/cpu_core/cpus")
    e_list = _read(root / "sys/devices/cpu_atom/cpus")
    if p_list is not None or e_list is not None:
        e_cpus = set(parse_cpulist(e_list or ""))
        return {cpu: "E" if cpu in e_cpus else "P" for cpu in cpus}, "sys/devices/cpu_core and cpu_atom", True
    if cpus and all(freqs[cpu] for cpu in cpus):
        distinct = sorted(set(freqs.values()))
        gaps = [(distinct[i + 1] / distinct[i], i) for i in range(len(distinct) - 1)]
        if gaps and max(gaps)[0] >= HYBRID_FREQ_GAP:
            split = distinct[max(gaps)[1] + 1]
            kinds = {cpu: "P" if freqs[cpu] >= split else "E" for cpu in cpus}
            below = distinct[max(gaps)[1]]
            source = (f"cpufreq/cpuinfo_max_freq: P-cores reach {split // 1000} MHz or more, "
                      f"E-cores {below // 1000} MHz or less")
            return kinds, source, True
        return {cpu: "P" for cpu in cpus}, "cpufreq/cpuinfo_max_freq: one core type", True
    source = "unknown (no cpu_core/cpu_atom lists, no cpufreq): all cores treated alike"
    return {cpu: "P" for cpu in cpus}, source, False
