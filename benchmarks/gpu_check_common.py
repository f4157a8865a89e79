"""What the parts of benchmarks/gpu_check.py share: the report, CUDA timing, errors against the torch
path, and the checkout's kernel files imported by path (needs only torch and triton)."""

import functools
import importlib.util
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

DEVICE = "cuda"
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


class Report:
    """Prints each line and appends it to the output file at once."""

    def __init__(self, path):
        self.path = path
        open(path, "w").close()

    def line(self, text=""):
        print(text, flush=True)
        with open(self.path, "a") as f:
            f.write(text + "\n")


def cuda_time_s(fn, iters, warmup=2):
    """Mean seconds per call of ``fn`` measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / iters


def relative_error(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@functools.cache
def kernel_module(name):
    """``gpushare/kernels/<name>.py`` of this checkout, imported by path (needs only torch and triton)."""
    spec = importlib.util.spec_from_file_location(f"gpu_check_{name}", ROOT / "gpushare" / "kernels" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
