"""What the parts of benchmarks/gpu_check.py share: the part's report, timing (CUDA events on a GPU,
the wall clock in the CPU dry run), errors against the torch path, the card's nominal peaks, Triton
compile counts, and the checkout's kernel files imported by path (needs only torch and triton).

Each part runs in a process of its own (gpu_check.py starts it), which reads its device from
``GPU_CHECK_DEVICE``: ``cuda`` on a lent GPU, ``cpu`` for the dry run that walks every part's code
with tiny shapes under Triton's interpreter, so that a typo is found here and not in the ten
minutes of a lent card.
"""

import functools
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")
DRY = DEVICE != "cuda"  # the CPU dry run: the same code with tiny shapes
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}

# Nominal dense bf16 tensor TFLOP/s and memory GB/s by the name CUDA reports (NVIDIA's data sheets);
# a card not listed is compared with the copy bandwidth and the bf16 matmul measured on it.
NOMINAL_PEAKS = {
    "H100 80GB HBM3": (989.0, 3350.0),  # SXM5
    "H100 PCIe": (756.0, 2000.0),
    "H100 NVL": (835.0, 3900.0),
    "H200": (989.0, 4800.0),
    "A100-SXM4-80GB": (312.0, 2039.0),
    "A100-SXM4-40GB": (312.0, 1555.0),
    "A100 80GB PCIe": (312.0, 1935.0),
    "L40S": (362.0, 864.0),
    "RTX 4090": (165.0, 1008.0),
    "RTX A6000": (155.0, 768.0),
}


class Report:
    """A part's output: lines printed as they come and kept, plus ``data`` (numbers, verdicts) that
    gpu_check.py merges into the one results file. ``failures`` counts checks that failed."""

    def __init__(self):
        self.lines, self.data, self.failures = [], {}, 0

    def line(self, text=""):
        print(text, flush=True)
        self.lines.append(text)

    def verdict(self, ok: bool) -> str:
        self.failures += not ok
        return "ok" if ok else "FAIL"

    def save(self, path):
        with open(path, "w") as f:
            json.dump({"lines": self.lines, "data": self.data, "failures": self.failures}, f, indent=1, default=str)


def synchronize():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def time_s(fn, iters, warmup=2):
    """Mean seconds per call of ``fn``: CUDA events on a GPU, the wall clock in the dry run."""
    for _ in range(warmup):
        fn()
    if DEVICE != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / iters


cuda_time_s = time_s  # the name gpu_quant_check.py uses


def relative_error(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def nominal_peaks():
    """(TFLOP/s, GB/s) of this card from NOMINAL_PEAKS, or (None, None)."""
    if DEVICE != "cuda":
        return None, None
    name = torch.cuda.get_device_name(0)
    for key, peaks in NOMINAL_PEAKS.items():
        if key in name:
            return peaks
    return None, None


def against(value, peak, unit):
    """``value`` with its fraction of ``peak`` where one is known: '812 GB/s (24% of 3350)'."""
    return f"{value:.0f} {unit}" + (f" ({value / peak:.0%} of {peak:.0f})" if peak else "")


def triton_compiled_count():
    """How many kernels Triton has compiled in this process for gpushare's and this check's @jit
    functions (their per-device caches), or None where it cannot tell (the interpreter keeps none)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    try:
        from triton.runtime.jit import _triton_jit_function_registry as registry
    except ImportError:
        return None
    count = 0
    for key, fn in list(registry.items()):
        if not key.startswith(("gpushare", "gpu_check")):
            continue
        for cache in getattr(fn, "device_caches", {}).values():
            count += len(cache[0]) if isinstance(cache, tuple) else len(cache)
    return count


@functools.cache
def kernel_module(name):
    """``gpushare/kernels/<name>.py`` of this checkout, imported by path (needs only torch and triton)."""
    spec = importlib.util.spec_from_file_location(f"gpu_check_{name}", ROOT / "gpushare" / "kernels" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # Triton finds a @jit function's globals through its module
    spec.loader.exec_module(module)
    return module
