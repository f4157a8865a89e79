"""The CPU's C++ kernels (``cpu_attention.cpp``, ``cpu_ops.cpp``, ``cpu_qmatmul.cpp``, ``cpu_decode.cpp``): built once per machine, loaded as ``torch.ops.gpushare``.

They are compiled with the system's C++ compiler for the CPU at hand (``-march=native``: the
machines this runs on differ, AVX2-only to AVX-512) against the installed torch's headers, a few
seconds, and kept in ``$XDG_CACHE_HOME/gpushare`` (or ``~/.cache/gpushare``) under a name that
covers the source, torch's version, the compiler and the CPU, so a change of any builds anew.
Where they cannot be built (no compiler, a failed build), the torch path runs instead and the
reason is logged once. ``GPUSHARE_KERNELS=torch`` (or ``triton``) keeps them out of the dispatch
(kernels/__init__.py).
"""

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("gpushare.kernels")

SOURCES = [Path(__file__).with_name(name) for name in ("cpu_ops.cpp", "cpu_attention.cpp", "cpu_qmatmul.cpp", "cpu_decode.cpp")]
HEADERS = [Path(__file__).with_name(name) for name in ("cpu_kernels.h", "cpu_rows.h")]
# -ffp-contract=off: no fused multiply-adds the torch path does not make (RoPE stays bit for bit)
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared", "-std=c++20"]
BUILD_TIMEOUT_S = 300


def _cpu_identity() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return os.uname().machine


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def library_path(compiler: str) -> Path:
    """Where this machine's build is kept."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("|".join([*(s.read_text() for s in SOURCES + HEADERS), *FLAGS, torch.__version__, version, _cpu_identity()]).encode())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpushare"
    return cache / f"cpu-ops-{key.hexdigest()[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    from torch.utils import cpp_extension

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as f:
        partial = Path(f.name)
    command = [compiler, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               *[f"-I{p}" for p in cpp_extension.include_paths()], *map(str, SOURCES), "-o", str(partial),
               *[f"-L{p}" for p in cpp_extension.library_paths()], "-lc10", "-ltorch_cpu"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(partial, target)  # atomic: another process building at once keeps a whole file too
    finally:
        partial.unlink(missing_ok=True)


@functools.cache
def build_key() -> str:
    """The key of this machine's build (source, flags, torch, compiler, CPU): what verdicts measured on
    these kernels are kept against (models/cpu_kernels.py)."""
    compiler = _compiler()
    return library_path(compiler).stem.removeprefix("cpu-ops-") if compiler else "none"


@functools.cache
def loaded() -> bool:
    """Whether ``torch.ops.gpushare`` holds the C++ kernels (built first if this machine has none)."""
    compiler = _compiler()
    if compiler is None:
        log.warning("no C++ compiler (g++, or $CXX): the CPU runs the slower torch attention path")
        return False
    try:
        target = library_path(compiler)
        if not target.exists():
            log.info("building the CPU kernels for this machine into %s", target)
            _build(compiler, target)
        torch.ops.load_library(str(target))
    except Exception as e:
        log.warning("cannot build the CPU kernels, the CPU runs the slower torch attention path: %s", e)
        return False
    return True
