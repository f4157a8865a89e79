"""How the devices of one node are linked: `nvidia-smi topo -m` parsed, and links ranked.

`nvidia-smi topo -m` prints a matrix whose cells name the path between two GPUs: `NV<n>`
(n bonded NVLinks), `PIX` (one PCIe switch), `PXB` (several PCIe switches, not the host
bridge), `PHB` (a PCIe host bridge), `NODE` (host bridges of one NUMA node), `SYS` (the
inter-socket link; old drivers print `SOC`). NIC columns and rows are ignored; the `CPU
Affinity` / `NUMA Affinity` columns are kept per GPU. A row that is missing (a fragment, or a
driver that lists fewer rows) takes its links from the other rows' columns, since the matrix
is symmetric; a pair nobody states is "unknown", ranked as SYS.

Between two CPU workers (`cpu`, `cpu:LIST`) the link is "NUMA-local" when both sit on one
NUMA node, else "SYS". A MIG instance has no peer-to-peer path (NVIDIA's MIG guide: no
GPU-to-GPU P2P, PCIe or NVLink), so between MIG workers traffic goes through host memory: at
best PHB, whatever links their parent GPUs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gpushare.node.devices import WorkerPlan
from gpushare.node.nvsmi import NVIDIA_SMI
from gpushare.node.runner import Command, NodeError
from gpushare.node.topology import parse_cpulist

UNKNOWN = "unknown"
NUMA_LOCAL = "NUMA-local"
SELF = "X"
# Higher is better. NV<n> ranks above all of these, more links higher (link_rank).
_PCIE_RANKS = {"PIX": 6, "PXB": 5, "PHB": 4, "NODE": 3, NUMA_LOCAL: 3, "SYS": 1, "SOC": 1, UNKNOWN: 1}
_NVLINK = re.compile(r"^NV(\d+)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # some drivers underline the header when writing to a terminal
_GPU = re.compile(r"^GPU(\d+)$")
_AFFINITY_COLUMNS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
_DESCRIPTIONS = {
    "PIX": "one PCIe switch (PIX)",
    "PXB": "several PCIe switches, not the CPU's host bridge (PXB)",
    "PHB": "a PCIe host bridge (PHB)",
    "NODE": "PCIe host bridges of one NUMA node (NODE)",
    "SYS": "the inter-socket link (SYS)",
    "SOC": "the inter-socket link (SOC)",
    NUMA_LOCAL: "the memory of one NUMA node (NUMA-local)",
    UNKNOWN: "an unknown path (nvidia-smi topo -m does not say; taken as SYS)",
}


def link_rank(link: str) -> int:
    """Best first: NV<n> (more links better) > PIX > PXB > PHB > NODE = NUMA-local > SYS = unknown."""
    if link == SELF:
        return 10_000
    if match := _NVLINK.match(link):
        return 100 + int(match.group(1))
    return _PCIE_RANKS.get(link, 1)


def describe_link(link: str) -> str:
    """'NV18' -> 'NVLink (NV18: 18 bonded links)', for messages."""
    if match := _NVLINK.match(link):
        return f"NVLink ({link}: {match.group(1)} bonded links)"
    return _DESCRIPTIONS.get(link, link)


def is_cross_socket(link: str) -> bool:
    return link_rank(link) <= link_rank("SYS")


@dataclass
class GpuLinks:
    """GPU-to-GPU links by NVML index (nvidia-smi's GPU<n>), with each GPU's affinity columns."""

    cells: dict[tuple[int, int], str] = field(default_factory=dict)  # both (a, b) and (b, a)
    cpu_affinity: dict[int, list[int]] = field(default_factory=dict)  # GPUs whose row says
    numa_affinity: dict[int, int] = field(default_factory=dict)
    gpus: list[int] = field(default_factory=list)  # every GPU the header names

    def link(self, a: int, b: int) -> str:
        return SELF if a == b else self.cells.get((a, b), UNKNOWN)


def topo_command() -> Command:
    return Command((NVIDIA_SMI, "topo", "-m"))


def read_gpu_links(runner) -> GpuLinks:
    result = runner.run(topo_command())
    if not result.ok:
        raise NodeError(f"`{result.command.shell()}` failed (exit {result.returncode}): {result.output.strip()}")
    return parse_topo_matrix(result.stdout)


def parse_topo_matrix(text: str) -> GpuLinks:
    """The GPU part of `nvidia-smi topo -m`, raw (tab-separated) or tab-expanded. Row cells never
    hold spaces, so rows split on whitespace; only the header has multi-word column names."""
    links = GpuLinks()
    columns: list[str] | None = None
    extras: list[str] = []
    for line in _ANSI.sub("", text).splitlines():
        tokens = line.split()
        if tokens and tokens[0].startswith("Legend"):
            break
        if not tokens:
            continue
        if columns is None:  # the header: the first line that starts with GPU0
            if not _GPU.match(tokens[0]):
                continue
            columns, extras = _header(line)
            links.gpus = [int(m.group(1)) for c in columns if (m := _GPU.match(c))]
            continue
        row = _GPU.match(tokens[0])
        if row is None:
            continue  # a NIC row
        gpu = int(row.group(1))
        for column, cell in zip(columns, tokens[1:1 + len(columns)]):
            other = _GPU.match(column)
            if other and int(other.group(1)) != gpu and cell != SELF:
                links.cells.setdefault((gpu, int(other.group(1))), cell)
                links.cells.setdefault((int(other.group(1)), gpu), cell)
        for name, cell in zip(extras, tokens[1 + len(columns):]):
            if name == "CPU Affinity" and cell != "N/A":
                links.cpu_affinity[gpu] = parse_cpulist(cell)
            elif name == "NUMA Affinity" and cell.isdigit():
                links.numa_affinity[gpu] = int(cell)
    return links


def _header(line: str) -> tuple[list[str], list[str]]:
    """Device columns (GPU<n>, NIC<n>, mlx5_<n>...) and, after them, the affinity columns in order."""
    positions = sorted((line.find(name), name) for name in _AFFINITY_COLUMNS if name in line)
    devices_end = positions[0][0] if positions else len(line)
    return line[:devices_end].split(), [name for _, name in positions]


def worker_link(a: WorkerPlan, b: WorkerPlan, links: GpuLinks) -> str:
    """The link between two engine workers of one kind (see worker_kind)."""
    if a.torch_device == "cpu":
        same_node = a.numa_node is not None and a.numa_node == b.numa_node
        return NUMA_LOCAL if same_node else "SYS"
    if a.gpu_index is None or b.gpu_index is None:
        return UNKNOWN
    link = links.link(a.gpu_index, b.gpu_index)
    if a.mig_uuid is not None and link_rank(link) > link_rank("PHB"):
        return "PHB"  # no P2P between MIG instances, even on one GPU: through host memory
    return link


def worker_kind(worker: WorkerPlan) -> str:
    """'gpu', 'mig' or 'cpu': workers of different kinds never form one tensor-parallel group."""
    if worker.torch_device == "cpu":
        return "cpu"
    return "mig" if worker.mig_uuid is not None else "gpu"
