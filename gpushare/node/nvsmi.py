"""nvidia-smi commands gpushare reads, and parsers for their text.

`nvidia-smi -L`, `--query-gpu=... --format=csv,noheader`, `mig -lgip`, `mig -lgi`,
`mig -lci`, and the messages of `-mig 1`, `mig -cgi`, `-dci`, `-dgi`. The parsers follow
the tables as real drivers print them (tests feed captured outputs): a row is recognised by
its content, not by column positions, so wider names (`7g.141gb`) and the older `-lci`
layout without a Placement column parse the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gpushare.node.runner import Command, NodeError

NVIDIA_SMI = "nvidia-smi"
QUERY_FIELDS = "index,uuid,name,pci.bus_id,mig.mode.current,mig.mode.pending,compute_mode"
# What nvidia-smi prints instead of a table when there is nothing to list.
_NOTHING = ("No MIG-enabled devices found", "No GPU instances found", "No compute instances found")


@dataclass
class ListedMigDevice:
    profile: str
    device_index: int
    uuid: str  # MIG-<uuid>, or the legacy R450/R460 form MIG-GPU-<uuid>/<gi>/<ci>


@dataclass
class ListedGpu:
    index: int
    name: str
    uuid: str
    mig_devices: list[ListedMigDevice] = field(default_factory=list)


@dataclass
class GpuRow:
    """One line of `--query-gpu`: mig modes are "Enabled", "Disabled" or "[N/A]"."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str
    mig_current: str
    mig_pending: str
    compute_mode: str

    @property
    def mig_supported(self) -> bool:
        return self.mig_current in ("Enabled", "Disabled")


@dataclass
class GiProfile:
    gpu: int
    name: str  # "3g.71gb"
    profile_id: int
    free: int
    total: int
    memory_gib: float

    @property
    def slices(self) -> int:
        return int(self.name.split("g.", 1)[0])


@dataclass
class GpuInstance:
    gpu: int
    profile: str
    profile_id: int
    instance_id: int
    placement: tuple[int, int] | None


@dataclass
class ComputeInstance:
    gpu: int
    gpu_instance_id: int
    profile: str
    profile_id: int
    instance_id: int


def list_command() -> Command:
    return Command((NVIDIA_SMI, "-L"))


def query_command() -> Command:
    return Command((NVIDIA_SMI, f"--query-gpu={QUERY_FIELDS}", "--format=csv,noheader"))


def mig_command(gpu: int, *args: str) -> Command:
    return Command((NVIDIA_SMI, "mig", "-i", str(gpu), *args))


def read_gpu_rows(runner) -> list[GpuRow]:
    result = runner.run(query_command())
    if not result.ok:
        raise NodeError(f"`{result.command.shell()}` failed (exit {result.returncode}): {result.output.strip()}")
    return parse_query(result.stdout)


def read_listed_gpus(runner) -> list[ListedGpu]:
    result = runner.run(list_command())
    if not result.ok:
        raise NodeError(f"`{result.command.shell()}` failed (exit {result.returncode}): {result.output.strip()}")
    return parse_list(result.stdout)


def nothing_listed(text: str) -> bool:
    return any(marker in text for marker in _NOTHING)


_GPU_LINE = re.compile(r"^GPU (\d+): (.*) \(UUID: (GPU-[^)]+)\)\s*$")
_MIG_LINE = re.compile(r"^\s+MIG (\S+)\s+Device\s+(\d+): \(UUID: ([^)]+)\)\s*$")


def parse_list(text: str) -> list[ListedGpu]:
    gpus: list[ListedGpu] = []
    for line in text.splitlines():
        if match := _GPU_LINE.match(line):
            gpus.append(ListedGpu(int(match.group(1)), match.group(2), match.group(3)))
        elif (match := _MIG_LINE.match(line)) and gpus:
            gpus[-1].mig_devices.append(ListedMigDevice(match.group(1), int(match.group(2)), match.group(3)))
    return gpus


def parse_query(text: str) -> list[GpuRow]:
    rows = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != 7 or not cells[0].isdigit():
            continue
        rows.append(GpuRow(int(cells[0]), *cells[1:]))
    return rows


_LGIP_ROW = re.compile(r"^\|\s*(\d+)\s+MIG\s+(\S+)\s+(\d+)\s+(\d+)/(\d+)\s+([\d.]+)\s")
_LGI_ROW = re.compile(r"^\|\s*(\d+)\s+MIG\s+(\S+)\s+(\d+)\s+(\d+)\s+(\d+):(\d+)\s*\|")
_LCI_ROW = re.compile(r"^\|\s*(\d+)\s+(\d+)\s+MIG\s+(\S+)\s+(\d+)\s+(\d+)(?:\s+\d+:\d+)?\s*\|")


def parse_gi_profiles(text: str) -> list[GiProfile]:
    """`nvidia-smi mig -lgip`: each profile's first row line; the second (CE/JPEG/OFA) is skipped."""
    return [
        GiProfile(int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4)), int(m.group(5)), float(m.group(6)))
        for line in text.splitlines() if (m := _LGIP_ROW.match(line))
    ]


def parse_gpu_instances(text: str) -> list[GpuInstance]:
    return [
        GpuInstance(int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4)), (int(m.group(5)), int(m.group(6))))
        for line in text.splitlines() if (m := _LGI_ROW.match(line))
    ]


def parse_compute_instances(text: str) -> list[ComputeInstance]:
    return [
        ComputeInstance(int(m.group(1)), int(m.group(2)), m.group(3), int(m.group(4)), int(m.group(5)))
        for line in text.splitlines() if (m := _LCI_ROW.match(line))
    ]


_CREATED_GI = re.compile(r"Successfully created GPU instance ID\s+(\d+)")
_CREATED_CI = re.compile(r"Successfully created compute instance")
_UNABLE = re.compile(r"^(?:Unable to|Failed to) [^:]*:\s*(.+?)\s*$")


def created_gpu_instances(text: str) -> list[int]:
    return [int(m.group(1)) for m in _CREATED_GI.finditer(text)]


def created_compute_instances(text: str) -> int:
    return len(_CREATED_CI.findall(text))


def failure_reason(text: str) -> str | None:
    """'Insufficient Resources' from 'Failed to create GPU instances: Insufficient Resources'."""
    reasons = [m.group(1) for line in text.splitlines() if (m := _UNABLE.match(line.strip()))]
    return reasons[-1] if reasons else None


_PENDING = re.compile(r"MIG mode is in pending (\w+) state for GPU ([0-9A-Fa-f]+:[0-9A-Fa-f]+:[0-9A-Fa-f.]+):(.+)$",
                      re.MULTILINE)


def pending_mode_change(text: str) -> str | None:
    """`-mig 1` prints 'All done.' even when the change is only pending; say why instead."""
    match = _PENDING.search(text)
    if match is None:
        return None
    return f"MIG mode is pending {match.group(1)} on {match.group(2)}: {match.group(3).strip()}"
