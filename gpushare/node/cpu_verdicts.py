"""The CPU kernel verdicts this machine keeps (models/cpu_kernels.py makes them): where they live, and
reading and writing them, torch-free, so the supervisor and ``gpushare node topo`` can show them.

One JSON file per verdict, CPU model and torch version under ``$XDG_CACHE_HOME/gpushare`` (or
``~/.cache/gpushare``). A file that does not parse or holds an unknown choice is ignored with a log
line (and measured again by whoever makes the verdict), as is one measured on another build of the
kernels when the caller names the build it runs.
"""

import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("gpushare.models")

KERNEL_CHOICES = ("blocks", "torch")
WIDE_CHOICES = ("bfloat16", "int8pack")
CHOICES = {"quantized-kernel": KERNEL_CHOICES, "wide-int8": WIDE_CHOICES}
WHAT = {"quantized-kernel": "quantized linears", "wide-int8": "int8 prefill rows on torch's kernel"}
SIMD_FLAGS = ("avx2", "fma", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16")


@dataclass
class Verdict:
    """One kept verdict: what was chosen, on which kernels build, from which timings."""
    choice: str
    build_key: str
    timings_us: dict[str, float]
    measured_at: str


def read_verdict(name: str, build_key: str | None = None) -> Verdict | None:
    """This machine's kept verdict on ``name``; None (logged) for a file that does not parse, holds an
    unknown choice or, where ``build_key`` is given, was measured on another build of the kernels."""
    path = verdict_file(name)
    try:
        text = path.read_text()
    except OSError:
        return None
    try:
        raw = json.loads(text)
        verdict = Verdict(str(raw["choice"]), str(raw["build_key"]), dict(raw["timings_us"]), str(raw["measured_at"]))
    except (ValueError, KeyError, TypeError):
        log.warning("ignoring %s: not a verdict file of this version (measuring again)", path)
        return None
    if verdict.choice not in CHOICES[name]:
        log.warning("ignoring %s: unknown choice %r (measuring again)", path, verdict.choice)
        return None
    if build_key is not None and verdict.build_key != build_key:
        log.info("ignoring %s: measured on kernels build %s, this is %s (measuring again)", path,
                 verdict.build_key, build_key)
        return None
    return verdict


def verdict_file(name: str) -> Path:
    """Where this machine's verdict on ``name`` is kept: one file per CPU model and torch version."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line for line in open("/proc/cpuinfo") if line.startswith("model name")).split(":", 1)[1]
    except (OSError, StopIteration):
        pass
    # torch's version from its package metadata (the same string as torch.__version__), not torch
    key = hashlib.sha256(f"{cpu.strip()}|{importlib.metadata.version('torch')}".encode()).hexdigest()[:16]
    return cache_dir() / f"cpu-kernel-{name}-{key}.json"


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpushare"


def kept_verdicts() -> dict[str, Verdict | None]:
    """Every kept verdict of this machine by name (None: not measured yet), for logs and listings."""
    return {name: read_verdict(name) for name in CHOICES}


def keep_verdict(name: str, verdict: Verdict) -> str:
    """Store ``verdict`` (replacing an ignored file); return its choice."""
    path = verdict_file(name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as f:
            json.dump(verdict.__dict__, f)
        os.replace(f.name, path)
    except OSError as e:
        log.warning("cannot keep the CPU kernel choice in %s (%s): other processes may measure another", path, e)
    return verdict.choice


def simd_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str] | None:
    """The CPU's flags that decide which SIMD paths the C++ kernels build (in ``SIMD_FLAGS`` order);
    None where ``cpuinfo`` cannot be read."""
    try:
        with open(cpuinfo) as f:
            flags = set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return None
    return [flag for flag in SIMD_FLAGS if flag in flags]


def describe(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """Lines for logs and ``gpushare node topo``: the SIMD flags and each kept verdict."""
    flags = simd_flags(cpuinfo)
    if flags is None:
        lines = [f"SIMD flags: unknown (cannot read {cpuinfo})"]
    else:
        lines = [f"SIMD flags: {' '.join(flags) or 'none of ' + ', '.join(SIMD_FLAGS)}"]
    for name, verdict in kept_verdicts().items():
        if verdict is None:
            lines.append(f"{WHAT[name]}: not measured yet (measured at the first model load that needs it)")
        else:
            timings = ", ".join(f"{k} {v:.0f} us" for k, v in verdict.timings_us.items())
            lines.append(f"{WHAT[name]}: {verdict.choice} (measured {verdict.measured_at}: {timings}; "
                         f"kernels build {verdict.build_key})")
    return lines
