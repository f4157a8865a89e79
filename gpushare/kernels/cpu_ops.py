"""The CPU's C++ kernels (``cpu_attention.cpp``, ``cpu_ops.cpp``, ``cpu_qmatmul.cpp``, ``cpu_lora.cpp``, ``cpu_decode.cpp``): built once per machine, loaded as ``torch.ops.gpushare``.

They are compiled with the system's C++ compiler for the CPU at hand against the installed torch's
headers, a few seconds, for one instruction set (``isa``): ``avx512`` (AVX-512 with VNNI where the
CPU has it), ``avxvnni`` (AVX2 with the VEX-encoded AVX-VNNI dot products of the Intel hybrid
CPUs), ``avx2`` (AVX2, FMA and F16C: maddubs/madd dot products) or ``portable`` (the plain loops, no
AVX), the best the CPU's flags allow unless ``GPUSHARE_CPU_ISA`` names another the CPU can run (so
one machine builds and tests them all). Every ISA's kernels give the same bits. A build is kept in
``$XDG_CACHE_HOME/gpushare`` (or ``~/.cache/gpushare``) under a name that covers the ISA and its
flags, the source, torch's version, the compiler and the CPU, so a change of any builds anew.
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
import time
from pathlib import Path

import torch

log = logging.getLogger("gpushare.kernels")

SOURCES = [Path(__file__).with_name(name)
           for name in ("cpu_ops.cpp", "cpu_attention.cpp", "cpu_qmatmul.cpp", "cpu_lora.cpp", "cpu_decode.cpp")]
HEADERS = [Path(__file__).with_name(name) for name in ("cpu_kernels.h", "cpu_rows.h", "cpu_qmatmul.h", "cpu_qmatmul_256.h",
                                                       "cpu_team.h", "cpu_attention_rows.h", "cpu_attention_256.h",
                                                       "cpu_attention_512.h", "cpu_attention_prompt.h")]
# -ffp-contract=off: no fused multiply-adds the torch path does not make (RoPE stays bit for bit)
FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared", "-std=c++20"]
BUILD_TIMEOUT_S = 900  # a busy machine: the compile needs ~40 s of CPU, and may get a fraction of a core
ISAS = ("avx512", "avxvnni", "avx2", "portable")  # best first
# The /proc/cpuinfo flags each ISA needs, and its compiler flags: the CPU's own (-march=native) less
# the wider sets, so a build tuned for this CPU still runs only the ISA it is named for.
ISA_NEEDS = {"avx512": {"avx512f", "avx512bw", "avx2", "fma", "f16c"}, "avxvnni": {"avx_vnni", "avx2", "fma", "f16c"},
             "avx2": {"avx2", "fma", "f16c"}, "portable": set()}
ISA_FLAGS = {"avx512": ["-march=native"], "avxvnni": ["-march=native", "-mno-avx512f"],
             "avx2": ["-march=native", "-mno-avx512f", "-mno-avxvnni"], "portable": ["-march=native", "-mno-avx"]}


def cpu_flags() -> set[str]:
    """The CPU's feature flags, as /proc/cpuinfo names them (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), ":").split(":", 1)[1].split())
    except OSError:
        return set()


def runnable_isas(flags: set[str] | None = None) -> list[str]:
    """The ISAs this CPU (or one with ``flags``) runs, best first; ``portable`` always."""
    flags = cpu_flags() if flags is None else flags
    return [isa for isa in ISAS if isa == "portable" or (_x86() and ISA_NEEDS[isa] <= flags)]


@functools.cache
def isa() -> str:
    """The ISA the kernels are built for: ``GPUSHARE_CPU_ISA`` where this CPU runs it, else the best it runs."""
    runnable = runnable_isas()
    forced = os.environ.get("GPUSHARE_CPU_ISA", "")
    if forced and forced not in runnable:
        log.warning("GPUSHARE_CPU_ISA=%s: %s; building for %s", forced,
                    "this CPU does not run it" if forced in ISAS else f"not one of {', '.join(ISAS)}", runnable[0])
    return forced if forced in runnable else runnable[0]


def isa_flags(name: str) -> list[str]:
    """The compiler flags of ISA ``name`` (off x86, the CPU's own and nothing to take away)."""
    return ISA_FLAGS[name] if _x86() else ["-march=native"]


def _x86() -> bool:
    return os.uname().machine in ("x86_64", "AMD64", "i686")


def _cpu_identity() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return os.uname().machine


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def library_path(compiler: str, name: str | None = None) -> Path:
    """Where this machine's build for ISA ``name`` (default: ``isa()``) is kept."""
    name = name or isa()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("|".join([*(s.read_text() for s in SOURCES + HEADERS), *FLAGS, name, *isa_flags(name),
                                   torch.__version__, version, _cpu_identity()]).encode())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpushare"
    return cache / f"cpu-ops-{name}-{key.hexdigest()[:16]}.so"


def _build(compiler: str, target: Path, name: str) -> None:
    """Compile each source at once (one process a source: the cores share the work), then link."""
    from torch.utils import cpp_extension

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as f:
        partial = Path(f.name)
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    compile_flags = [*FLAGS, *isa_flags(name), f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                     *[f"-I{p}" for p in cpp_extension.include_paths()]]
    with tempfile.TemporaryDirectory(dir=target.parent) as objects:
        outputs = [str(Path(objects) / f"{source.stem}.o") for source in SOURCES]
        try:
            _run([[compiler, *compile_flags, "-c", str(source), "-o", out] for source, out in zip(SOURCES, outputs)],
                 deadline, compiler)
            _run([[compiler, *FLAGS, *outputs, "-o", str(partial), *[f"-L{p}" for p in cpp_extension.library_paths()],
                   "-lc10", "-ltorch_cpu"]], deadline, compiler)
            os.replace(partial, target)  # atomic: another process building at once keeps a whole file too
        finally:
            partial.unlink(missing_ok=True)


def _run(commands: list[list[str]], deadline: float, compiler: str) -> None:
    """Run ``commands`` side by side; raise with the first failure's errors, or when the deadline passes."""
    running = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for c in commands]
    try:
        for proc in running:
            _, errors = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {errors.strip()[-2000:]}")
    finally:
        for proc in running:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@functools.cache
def build_key() -> str:
    """The key of this machine's build (ISA, source, flags, torch, compiler, CPU), as ``ISA-HASH``: what
    verdicts measured on these kernels are kept against (models/cpu_kernels.py)."""
    compiler = _compiler()
    return library_path(compiler).stem.removeprefix("cpu-ops-") if compiler else "none"


@functools.cache
def loaded() -> bool:
    """Whether ``torch.ops.gpushare`` holds the C++ kernels (built first if this machine has none)."""
    compiler = _compiler()
    if compiler is None:
        log.warning("no C++ compiler (g++, or $CXX): the CPU runs the slower torch attention path")
        return False
    name = isa()
    try:
        target = library_path(compiler, name)
        if not target.exists():
            log.info("building the CPU kernels for this machine (%s) into %s", name, target)
            _build(compiler, target, name)
        torch.ops.load_library(str(target))
    except Exception as e:
        log.warning("cannot build the CPU kernels, the CPU runs the slower torch attention path: %s", e)
        return False
    log.info("CPU kernels: %s (%s)", name, torch.ops.gpushare.quantized_matmul_kernel())
    return True


def describe() -> dict:
    """What the CPU kernels run here, for logs and benchmark reports: the ISA built for, the block
    kernel's instructions, the build's key (what a kept timing of the kernels belongs to) and the CPU flags that decide them (None for what could not be loaded)."""
    shown = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx")) or f in ("fma", "f16c"))
    if not loaded():
        return {"isa": None, "block_kernel": None, "build": None, "cpu_flags": shown}
    return {"isa": isa(), "block_kernel": torch.ops.gpushare.quantized_matmul_kernel(),
            "build": build_key(), "cpu_flags": shown}
