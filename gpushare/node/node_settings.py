"""The `node:` section of gpushare's YAML config, parsed and validated.

    node:
      manage: false            # let `gpushare node apply` (and the daemon) change this node
      cpus: "0-7"              # engine CPUs, overriding the automatic P-core choice
      mig:                     # desired MIG layout per GPU: uuid, index or "all";
        all: ["3g.71gb", "3g.71gb"]   # profile names as `nvidia-smi mig -lgip` prints them;
                                      # [] means MIG off. GPUs not named are left alone.
      mps:
        enabled: false
        active_thread_percentage: 50  # 1..100, set before any client connects
        pinned_device_mem_limit: 40G  # integer + G or M, as nvidia-cuda-mps-control takes it
        root: /run/gpushare/mps       # pipe and log directories live under <root>/<uuid>/

Errors name the key: `ValueError("node.mps.active_thread_percentage: ...")`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gpushare.node.topology import parse_cpulist

MPS_ROOT = "/run/gpushare/mps"
_PROFILE_RE = re.compile(r"^\d+g\.\d+gb(\+[a-z]+)?$")
_MEM_LIMIT_RE = re.compile(r"^[1-9]\d*[GM]$")


@dataclass
class MpsSettings:
    enabled: bool = False
    active_thread_percentage: int | None = None
    pinned_device_mem_limit: str | None = None
    root: str = MPS_ROOT


@dataclass
class NodeSettings:
    manage: bool = False
    cpus: list[int] | None = None
    mig: dict[str, list[str]] = field(default_factory=dict)
    mps: MpsSettings = field(default_factory=MpsSettings)


def parse_node_settings(raw: dict | None) -> NodeSettings:
    """Validate the raw `node:` mapping (None or {} gives the defaults)."""
    if raw is None:
        return NodeSettings()
    if not isinstance(raw, dict):
        raise ValueError(f"node: expected a mapping, got {type(raw).__name__}")
    _reject_unknown("node", raw, {"manage", "cpus", "mig", "mps"})
    return NodeSettings(
        manage=_bool("node.manage", raw.get("manage", False)),
        cpus=_cpus(raw.get("cpus")),
        mig=_mig(raw.get("mig")),
        mps=_mps(raw.get("mps")),
    )


def normalize_profile(name: str) -> str:
    """'MIG 3g.71gb' (as -lgip prints it) and '3g.71gb' are the same profile."""
    name = name.strip()
    return name[4:].strip() if name.startswith("MIG ") else name


def _reject_unknown(where: str, raw: dict, known: set[str]) -> None:
    unknown = sorted(str(key) for key in raw if key not in known)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")


def _bool(key: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key}: expected true or false, got {value!r}")
    return value


def _cpus(value) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            cpus = parse_cpulist(value)
        except ValueError:
            raise ValueError(f"node.cpus: {value!r} is not a CPU list like '0-7,16-23'") from None
    elif isinstance(value, list) and all(isinstance(c, int) and not isinstance(c, bool) for c in value):
        cpus = sorted(set(value))
    else:
        raise ValueError(f"node.cpus: expected a list of CPU numbers or a string like '0-7,16-23', got {value!r}")
    if not cpus or cpus[0] < 0:
        raise ValueError(f"node.cpus: expected at least one CPU number >= 0, got {value!r}")
    return cpus


def _mig(value) -> dict[str, list[str]]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"node.mig: expected a mapping of GPU (uuid, index or 'all') to profile list, got {value!r}")
    layouts: dict[str, list[str]] = {}
    for key, profiles in value.items():
        gpu = str(key)
        where = f"node.mig.{gpu}"
        if not (gpu == "all" or gpu.isdigit() or gpu.startswith("GPU-")):
            raise ValueError(f"{where}: the key must be a GPU uuid (GPU-...), a GPU index or 'all'")
        if not isinstance(profiles, list) or not all(isinstance(p, str) for p in profiles):
            raise ValueError(f"{where}: expected a list of profile names like ['3g.71gb', '3g.71gb'], got {profiles!r}")
        names = [normalize_profile(p) for p in profiles]
        for name in names:
            if not _PROFILE_RE.match(name):
                raise ValueError(f"{where}: {name!r} is not a GPU instance profile name like '3g.71gb' or '1g.18gb+me'")
        layouts[gpu] = names
    return layouts


def _mps(value) -> MpsSettings:
    if value is None:
        return MpsSettings()
    if not isinstance(value, dict):
        raise ValueError(f"node.mps: expected a mapping, got {value!r}")
    _reject_unknown("node.mps", value, {"enabled", "active_thread_percentage", "pinned_device_mem_limit", "root"})
    percentage = value.get("active_thread_percentage")
    if percentage is not None and (
        isinstance(percentage, bool) or not isinstance(percentage, int) or not 1 <= percentage <= 100
    ):
        raise ValueError(f"node.mps.active_thread_percentage: expected a whole number 1..100, got {percentage!r}")
    limit = value.get("pinned_device_mem_limit")
    if limit is not None and (not isinstance(limit, str) or not _MEM_LIMIT_RE.match(limit)):
        raise ValueError("node.mps.pinned_device_mem_limit: expected a whole number followed by G or M "
                         f"(e.g. '40G'), got {limit!r}")
    root = value.get("root", MPS_ROOT)
    if not isinstance(root, str) or not root.startswith("/"):
        raise ValueError(f"node.mps.root: expected an absolute path, got {root!r}")
    if root == "/tmp" or root.startswith("/tmp/"):
        raise ValueError("node.mps.root: must not be under /tmp (systemd's PrivateTmp hides it from other services)")
    enabled = _bool("node.mps.enabled", value.get("enabled", False))
    return MpsSettings(enabled, percentage, limit, root.rstrip("/") or "/")
