"""Which CPU kernels run quantized weights here: measured, not assumed.

CPUs of one machine kind differ (AVX2-only, AVX-512 with VNNI and bf16, AMX), so three choices
are timed on the CPU at hand rather than fixed: whether int8 weights beat float32 at all
(``quantized_cpu_weights``: ``auto`` weights take int8 for a quantized file only where it wins);
which kernel multiplies int8 and int4 weights (``quantized_kernel``: the C++ block kernel or
torch's weight-only ones); and, on torch's, how wide prefill rows run (``wide_int8_kernel``).
Each timing uses a small model's shapes and takes a fraction of a second; its verdict is kept for
the process and in a small file per CPU model and torch version (``$XDG_CACHE_HOME/gpushare`` or
``~/.cache/gpushare``; delete it to measure again), so that every process on the machine, the
daemon and an offline ``LLM`` alike, loads a model in the same format and answers alike.
``GPUSHARE_CPU_WEIGHTS=int8|float32``, ``GPUSHARE_CPU_QUANTIZED_KERNEL=blocks|torch`` and
``GPUSHARE_CPU_WIDE_INT8=bfloat16|int8pack`` override them. torch is imported only to measure: the
daemon's supervisor reads the kept verdicts (``known_cpu_weights``, ``known_quantized_kernel``)
without loading it.
"""

import functools
import hashlib
import importlib.metadata
import logging
import os
import platform
import tempfile
import time
from pathlib import Path

log = logging.getLogger("gpushare.models")

CHOICES = ("int8", "float32")
KERNEL_CHOICES = ("blocks", "torch")
WIDE_CHOICES = ("bfloat16", "int8pack")
WIDE_CHUNK_TOKENS = 64  # a prefill chunk this long is "wide": see wide_int8_kernel
_WIDE_MEASURE_ROWS = 128  # near WIDE_CHUNK_TOKENS the two paths are even here, and timings too noisy to tell
_SHAPES = [(960, 576), (3072, 576), (576, 1536)]  # (out, in): a small model's qkv, gate_up, down


def best_time_s(fn, reps: int = 20) -> float:
    """Best of `reps`: the least disturbed by anything else the machine runs."""
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@functools.cache
def quantized_cpu_weights() -> str:
    """The faster format for a quantized file's weights on this CPU: "int8" or "float32"."""
    return known_cpu_weights() or _keep(verdict_file("weights"), _measure())


@functools.cache
def quantized_kernel() -> str:
    """Which kernel multiplies int8 and int4 weights on this CPU: "blocks" (kernels/cpu_qmatmul.cpp:
    activations quantized to int8 in blocks of 32, integer dot products, AVX-512 VNNI where the CPU
    has it) or "torch" (torch's weight-only kernels on bfloat16 activations). "torch" where the C++
    kernels cannot be built or ``GPUSHARE_KERNELS`` picks a path; otherwise measured (int8 weights at
    1 and 16 rows), kept like the weights verdict; ``GPUSHARE_CPU_QUANTIZED_KERNEL`` overrides it."""
    from gpushare.kernels import cpu_ops

    if os.environ.get("GPUSHARE_KERNELS") or not cpu_ops.loaded():
        return "torch"
    return known_quantized_kernel() or _keep(verdict_file("quantized-kernel"), _measure_kernel())


def known_quantized_kernel() -> str | None:
    """The override or this machine's kept kernel verdict; None when neither exists yet."""
    if os.environ.get("GPUSHARE_KERNELS"):
        return "torch"
    return _known("GPUSHARE_CPU_QUANTIZED_KERNEL", "quantized-kernel", KERNEL_CHOICES)


@functools.cache
def wide_int8_kernel() -> str:
    """How int8 linears compute the rows of wide prefill chunks on this CPU: "bfloat16" (the weight
    dequantized to bfloat16 at each call, then a bfloat16 GEMM) or "int8pack" (the decode kernel).
    ``_weight_int8pack_mm`` is the fastest at a few rows but falls behind as rows grow (measured on an
    AVX-512 bf16 CPU, one layer's linears at 1,024 rows: 24.8 ms against 9.0 ms dequantized); where
    bfloat16 is emulated the dequantized path may lose, hence the measurement (at 128 rows; at 64 the
    two are even here). Kept like the weights verdict; ``GPUSHARE_CPU_WIDE_INT8`` overrides it."""
    return _known("GPUSHARE_CPU_WIDE_INT8", "wide-int8", WIDE_CHOICES) or _keep(verdict_file("wide-int8"),
                                                                                _measure_wide())


def known_cpu_weights() -> str | None:
    """The override or this machine's kept verdict; None when neither exists yet (nothing measured)."""
    return _known("GPUSHARE_CPU_WEIGHTS", "weights", CHOICES)


def _known(variable: str, name: str, choices: tuple[str, ...]) -> str | None:
    """The choice the environment ``variable`` forces, else the machine's kept verdict on ``name``."""
    forced = os.environ.get(variable)
    if forced in choices:
        return forced
    try:
        known = verdict_file(name).read_text().strip()
    except OSError:
        return None
    return known if known in choices else None


def verdict_file(name: str) -> Path:
    """Where this machine's verdict on ``name`` is kept: one file per CPU model and torch version."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line for line in open("/proc/cpuinfo") if line.startswith("model name")).split(":", 1)[1]
    except (OSError, StopIteration):
        pass
    # torch's version from its package metadata (the same string as torch.__version__), not torch
    key = hashlib.sha256(f"{cpu.strip()}|{importlib.metadata.version('torch')}".encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpushare"
    return cache / f"cpu-kernel-{name}-{key}"


def _keep(verdict: Path, choice: str) -> str:
    """Store `choice` unless another process stored its own first; return the stored one."""
    try:
        verdict.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=verdict.parent, delete=False) as f:
            f.write(choice)
        try:
            os.link(f.name, verdict)  # fails if it exists: the first verdict stands
        except FileExistsError:
            choice = verdict.read_text().strip() or choice
        finally:
            os.unlink(f.name)
    except OSError as e:
        log.warning("cannot keep the CPU kernel choice in %s (%s): other processes may measure another", verdict, e)
    return choice


def _fastest(totals: dict[str, float], what: str, timed: str) -> str:
    """The choice with the least time in ``totals`` (seconds), logged with every choice's time."""
    choice = min(totals, key=totals.get)
    log.info("%s: %s (%s: %s)", what, choice, timed, ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in totals.items()))
    return choice


def _measure() -> str:
    import torch

    from gpushare.models.linear import Linear
    from gpushare.models.quantized import quantize_int8

    gen = torch.Generator().manual_seed(0)
    totals = {"int8": 0.0, "float32": 0.0}
    for n, k in _SHAPES:
        w = torch.randn(n, k, generator=gen) / 50
        int8, dense = Linear(k, n, bias=False), Linear(k, n, bias=False)
        int8.set_quantized(quantize_int8(w), "cpu")  # on the kernel this CPU runs int8 with
        dense.set_dense(w)
        x = torch.randn(1, k, generator=gen)
        totals["int8"] += best_time_s(lambda: int8(x))
        totals["float32"] += best_time_s(lambda: dense(x))
    return _fastest(totals, "CPU weights for quantized files", "batch-1 linears")


def _measure_kernel() -> str:
    import torch

    from gpushare.kernels import cpu_qmatmul
    from gpushare.models.quantized import quantize_int8

    gen = torch.Generator().manual_seed(0)
    totals = {"blocks": 0.0, "torch": 0.0}
    for n, k in _SHAPES:
        w = quantize_int8(torch.randn(n, k, generator=gen) / 50)
        codes, scales_bf16 = cpu_qmatmul.pack_int8(w.qweight), w.scales.bfloat16()
        for rows in (1, 16):
            x = torch.randn(rows, k, generator=gen)
            totals["blocks"] += best_time_s(lambda: cpu_qmatmul.matmul(x, codes, w.scales, None, n))
            totals["torch"] += best_time_s(
                lambda: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), w.qweight, scales_bf16).float())
    return _fastest(totals, "CPU kernel for quantized weights", "int8 linears at 1 and 16 rows")


def _measure_wide() -> str:
    import torch

    from gpushare.models.linear import Linear
    from gpushare.models.quantized import Int8Weight

    gen = torch.Generator().manual_seed(0)
    totals = {"bfloat16": 0.0, "int8pack": 0.0}
    for n, k in _SHAPES:
        linear = Linear(k, n, bias=False)
        linear.set_quantized(Int8Weight(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen),
                                        torch.rand(n, generator=gen) / 1000), "cpu", cpu_kernel="torch")
        x = torch.randn(_WIDE_MEASURE_ROWS, k, generator=gen).bfloat16()
        totals["bfloat16"] += best_time_s(lambda: linear._int8_wide(x, _WIDE_MEASURE_ROWS))
        totals["int8pack"] += best_time_s(lambda: torch.ops.aten._weight_int8pack_mm(x, linear.qweight,
                                                                                    linear.scales_bf16))
    return _fastest(totals, f"int8 linears over prefill chunks of {WIDE_CHUNK_TOKENS}+ tokens",
                    f"at {_WIDE_MEASURE_ROWS} rows")
