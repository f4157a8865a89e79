"""Which CPU kernels run quantized weights here: a default that is right, and a measurement that can
only move it when the gap is real.

A quantized file stays quantized on the CPU (weight_format): nothing here can make ``auto`` serve it
dense. Two narrower choices are still timed on the CPU at hand, since machines of one kind differ
(AVX2-only, AVX-512 with VNNI and bf16, AMX):
- ``quantized_kernel``: "blocks" (kernels/cpu_qmatmul.cpp) or "torch" (torch's weight-only kernels);
- ``wide_int8_kernel``: on torch's kernel, whether int8 rows of wide prefill chunks run on a
  dequantized bfloat16 copy ("bfloat16") or on the decode kernel ("int8pack").

Each is measured on a realistic size: a stack of a 1B-class model's layer matrices, larger than the
last-level cache (as a served model's weights are), so memory-bound kernels are timed as they run.
A difference under ``MARGIN`` keeps the default; a machine where other processes are using the CPU
is not measured at all (the default serves, unkept, and the next load tries again). A verdict is
kept (node/cpu_verdicts.py) with the kernels' build key it was measured on: a file that does not
parse, names another build or an unknown choice is ignored (logged) and measured again.
``GPUSHARE_CPU_QUANTIZED_KERNEL=blocks|torch`` and ``GPUSHARE_CPU_WIDE_INT8=bfloat16|int8pack``
override them. torch is imported only to measure.
"""

import logging
import os
import time
from pathlib import Path

from gpushare.node.cpu_verdicts import KERNEL_CHOICES, WIDE_CHOICES, Verdict, keep_verdict, read_verdict

log = logging.getLogger("gpushare.models")

WIDE_CHUNK_TOKENS = 64  # a prefill chunk this long is "wide": see wide_int8_kernel
MARGIN = 0.10  # a measured gap below this fraction of the slower time keeps the default
BUSY_CORES = 0.25  # other processes using more than this many cores make a measurement untrustworthy
MIN_STACK_BYTES, MAX_STACK_BYTES = 64 << 20, 768 << 20
# (out, in) of one layer of a 1B-class model: qkv, o, gate_up, down
LAYER_SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]
_WIDE_MEASURE_ROWS = 128  # near WIDE_CHUNK_TOKENS the two paths are even, and timings too noisy to tell

_decided: dict[str, str] = {}  # this process's verdicts: measured, kept, forced, or provisional
_provisional: set[str] = set()  # defaults taken on a busy machine: until the next model load


def best_time_s(fn, reps: int = 20) -> float:
    """Best of `reps`: the least disturbed by anything else the machine runs."""
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def quantized_kernel() -> str:
    """Which kernel multiplies int8 and int4 weights on this CPU: "blocks" (activations quantized to
    int8 in blocks of 32, integer dot products, SIMD for the CPU's ISA) or "torch" (torch's
    weight-only kernels on bfloat16 activations). "torch" where the C++ kernels cannot be built or
    ``GPUSHARE_KERNELS`` picks a path; "blocks" unless measured clearly slower."""
    from gpushare.kernels import cpu_ops

    if os.environ.get("GPUSHARE_KERNELS") or not cpu_ops.loaded():
        return "torch"
    return _decide("quantized-kernel", "GPUSHARE_CPU_QUANTIZED_KERNEL", KERNEL_CHOICES, "blocks",
                   _measure_kernel, "CPU kernel for quantized weights")


def wide_int8_kernel() -> str:
    """How int8 linears on torch's kernel compute the rows of wide prefill chunks: "bfloat16" (the
    weight dequantized to bfloat16 at each call, then a bfloat16 GEMM) or "int8pack" (the decode
    kernel). ``_weight_int8pack_mm`` is the fastest at a few rows but falls behind as rows grow
    (AVX-512 bf16, one layer's linears at 1,024 rows: 24.8 ms against 9.0 ms dequantized); where
    bfloat16 is emulated the dequantized path may lose, hence the measurement (at 128 rows)."""
    return _decide("wide-int8", "GPUSHARE_CPU_WIDE_INT8", WIDE_CHOICES, "bfloat16", _measure_wide,
                   f"int8 linears over prefill chunks of {WIDE_CHUNK_TOKENS}+ tokens")


def forget_verdicts() -> None:
    """Drop this process's verdicts, so the next call reads the environment and the kept files anew."""
    _decided.clear()
    _provisional.clear()


def measure_again_if_provisional() -> None:
    """At a model load: defaults taken because the machine was busy may be measured now. Within one
    load every linear gets the same answer (a verdict is asked once per linear)."""
    for name in _provisional:
        _decided.pop(name, None)
    _provisional.clear()


def known_quantized_kernel() -> str | None:
    """The override or this machine's kept kernel verdict, without measuring; None when neither exists."""
    if os.environ.get("GPUSHARE_KERNELS"):
        return "torch"
    forced = os.environ.get("GPUSHARE_CPU_QUANTIZED_KERNEL")
    if forced in KERNEL_CHOICES:
        return forced
    kept = read_verdict("quantized-kernel")
    return kept.choice if kept else None


def _decide(name: str, variable: str, choices: tuple[str, ...], default: str, measure, what: str) -> str:
    if name in _decided:
        return _decided[name]
    forced = os.environ.get(variable)
    if forced in choices:
        _decided[name] = forced
        return forced
    build_key = kernels_build_key()
    kept = read_verdict(name, build_key)
    if kept is not None:
        _decided[name] = kept.choice
        return kept.choice
    if (busy := other_processes_cores()) > BUSY_CORES:
        log.info("%s: %s, the default (not measured: other processes use %.1f cores; measured at a later load)",
                 what, default, busy)
        return _provisionally(name, default)
    totals, busy = measure()
    if busy > BUSY_CORES:
        log.info("%s: %s, the default (the measurement was disturbed: other processes used %.1f cores)",
                 what, default, busy)
        return _provisionally(name, default)
    choice = choose(totals, default)
    log.info("%s: %s (%s)", what, choice, ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in totals.items()))
    _decided[name] = keep_verdict(name, Verdict(choice, build_key, {k: round(v * 1e6, 1) for k, v in totals.items()},
                                         time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())))
    return _decided[name]


def _provisionally(name: str, default: str) -> str:
    _decided[name] = default
    _provisional.add(name)
    return default


def choose(totals_s: dict[str, float], default: str) -> str:
    """The fastest choice in ``totals_s``, unless it beats ``default`` by less than ``MARGIN``."""
    fastest = min(totals_s, key=totals_s.get)
    if fastest != default and totals_s[default] - totals_s[fastest] < MARGIN * totals_s[default]:
        return default
    return fastest


def kernels_build_key() -> str:
    """The key of the C++ kernels' build this process runs ("none" where they are not loaded)."""
    from gpushare.kernels import cpu_ops

    return cpu_ops.build_key() if cpu_ops.loaded() else "none"


def other_processes_cores(window_s: float = 0.2) -> float:
    """Cores' worth of CPU time the machine's other processes used over ``window_s``."""
    start = _cpu_seconds()
    time.sleep(window_s)
    return _others_since(start)


def _cpu_seconds() -> tuple[float, float, float] | None:
    """(wall clock, the machine's busy CPU seconds, this process's CPU seconds); None without /proc."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    mine = os.times()
    return (time.monotonic(), (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"),
            mine.user + mine.system)


def _others_since(start: tuple[float, float, float] | None) -> float:
    end = _cpu_seconds()
    if start is None or end is None or end[0] <= start[0]:
        return 0.0
    return max(0.0, (end[1] - start[1]) - (end[2] - start[2])) / (end[0] - start[0])


def stack_bytes() -> int:
    """The weights' bytes a measurement runs over: 1.5x the last-level cache, within bounds."""
    largest = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
            largest = max(largest, int(size.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(size[-1], 0))
        except (OSError, ValueError):
            continue
    return min(MAX_STACK_BYTES, max(MIN_STACK_BYTES, largest * 3 // 2))


def layer_stack(total_bytes: int) -> list[tuple[int, int]]:
    """Matrix shapes of whole layers (``LAYER_SHAPES``) until their int8 bytes reach ``total_bytes``."""
    shapes = []
    while sum(n * k for n, k in shapes) < total_bytes:
        shapes += LAYER_SHAPES
    return shapes


def _measure_kernel() -> tuple[dict[str, float], float]:
    """Seconds per pass over the stack for each kernel at 1 and 16 rows; other processes' cores meanwhile."""
    import torch

    from gpushare.kernels import cpu_qmatmul

    gen = torch.Generator().manual_seed(0)  # host: measures the CPU kernels
    weights = []
    for n, k in layer_stack(stack_bytes()):
        qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)  # host: CPU kernels' input
        scales = torch.rand(n, generator=gen) / 1000  # host: CPU kernels' input
        weights.append((n, qweight, cpu_qmatmul.pack_int8(qweight), scales, scales.bfloat16()))
    start = _cpu_seconds()
    totals = {"blocks": 0.0, "torch": 0.0}
    for rows in (1, 16):
        xs = {k: torch.randn(rows, k, generator=gen) for k in {w[1].shape[1] for w in weights}}  # host: CPU kernels
        totals["blocks"] += best_time_s(lambda: [cpu_qmatmul.matmul(xs[q.shape[1]], codes, s, None, n)
                                                 for n, q, codes, s, _ in weights], reps=3)
        totals["torch"] += best_time_s(lambda: [torch.ops.aten._weight_int8pack_mm(xs[q.shape[1]].bfloat16(), q, s16)
                                                for _, q, _, _, s16 in weights], reps=3)
    return totals, _others_since(start)


def _measure_wide() -> tuple[dict[str, float], float]:
    """Seconds per pass over the stack for each wide-row path at 128 rows; other processes' cores meanwhile."""
    import torch

    from gpushare.models.int8_wide import int8_wide_matmul

    gen = torch.Generator().manual_seed(0)  # host: measures the CPU kernels
    weights = [(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen),  # host: CPU kernels' input
                (torch.rand(n, generator=gen) / 1000).bfloat16())  # host: CPU kernels' input
               for n, k in layer_stack(stack_bytes())]
    xs = {k: torch.randn(_WIDE_MEASURE_ROWS, k, generator=gen).bfloat16()  # host: CPU kernels' input
          for k in {q.shape[1] for q, _ in weights}}
    start = _cpu_seconds()
    totals = {
        "bfloat16": best_time_s(lambda: [int8_wide_matmul(xs[q.shape[1]], q, s16, _WIDE_MEASURE_ROWS)
                                         for q, s16 in weights], reps=3),
        "int8pack": best_time_s(lambda: [torch.ops.aten._weight_int8pack_mm(xs[q.shape[1]], q, s16)
                                         for q, s16 in weights], reps=3),
    }
    return totals, _others_since(start)
