"""Load time: seconds per GB of GGUF blocks turned into float32, per quant type, before (gguf.quants'
numpy, what every type but Q4_0/Q4_1/Q8_0 went through) and after (gpushare.models.dequant's torch);
then whole loads of the bundled SmolLM2 GGUF per weight format, their time and their memory (each
format once more in a fresh process: its RSS after the load, and the peak RSS during it).

    .venv/bin/python benchmarks/load.py            # 256 MiB of blocks per type, 3 whole loads each
    .venv/bin/python benchmarks/load.py --quick    # 4 MiB per type, 1 whole load: a smoke run

Blocks are random bytes with finite random fp16 scales (the decoders' cost does not depend on the
values). Times are best of --reps on a warm page cache: conversion, not the disk. Run it with nothing
else running; the figures depend on --threads.
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from perplexity import find_gguf  # noqa: E402

from gpushare.models import dequant  # noqa: E402
from gpushare.models.cpu_kernels import best_time_s  # noqa: E402
from gpushare.models.loader import load_model  # noqa: E402

def blocks_of(type_name: str, n_bytes: int) -> tuple[np.ndarray, list[int]]:
    """About ``n_bytes`` of random ``type_name`` blocks as ``[rows, row bytes]``, and the float shape."""
    block_weights, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    per_row = 4096 // block_weights
    rows = max(1, n_bytes // (per_row * block_bytes))
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (rows * per_row, block_bytes), dtype=np.uint8)
    for offset in dequant.FP16_OFFSETS[type_name]:
        raw[:, offset:offset + 2] = (rng.standard_normal(len(raw)) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1), [rows, per_row * block_weights]


def per_type(n_bytes: int, reps: int) -> None:
    print(f"s per GB of blocks -> float32 ({n_bytes >> 20} MiB each, best of {reps})")
    print(f"{'type':8}{'gguf numpy':>12}{'torch':>10}{'speed-up':>10}")
    for type_name in dequant.FAST:
        raw, shape = blocks_of(type_name, n_bytes)
        gb = raw.nbytes / 1e9
        qtype = GGMLQuantizationType[type_name]
        before = best_time_s(lambda: quants.dequantize(raw, qtype), reps) / gb
        after = best_time_s(lambda: dequant.dequantize(raw, type_name, shape), reps) / gb
        print(f"{type_name:8}{before:12.2f}{after:10.2f}{before / after:9.1f}x", flush=True)


def whole_loads(weights: list[str], reps: int) -> None:
    path = find_gguf()
    gb = os.path.getsize(path) / 1e9
    print(f"\nwhole load of {os.path.basename(path)} ({gb:.2f} GB), s per GB, best of {reps}")
    for fmt in weights:
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            load_model(path, weights=fmt)
            best = min(best, time.perf_counter() - start)
        print(f"{fmt:10}{best / gb:8.2f}", flush=True)


def load_memory(weights: list[str]) -> None:
    print("\nmemory of one load in a fresh process, MiB (RSS after the load; the peak RSS during it)")
    print(f"{'weights':10}{'stored':>8}{'after':>8}{'peak':>8}{'peak/after':>12}")
    for fmt in weights:
        done = subprocess.run([sys.executable, __file__, "--memory-of", fmt], capture_output=True, text=True, check=True)
        m = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{fmt:10}{m['stored']:8.0f}{m['after']:8.0f}{m['peak']:8.0f}{m['peak'] / m['after']:11.2f}x", flush=True)


def memory_of(fmt: str) -> None:
    loaded = load_model(find_gguf(), weights=fmt)
    gc.collect()
    # VmHWM, not ru_maxrss: an exec keeps the forking parent's ru_maxrss, a fresh address space its own mark
    with open("/proc/self/status") as f:
        kib = {line.split(":")[0]: int(line.split()[1]) for line in f if line.startswith(("VmRSS", "VmHWM"))}
    print(json.dumps({"stored": loaded.weight_bytes / 2**20, "after": kib["VmRSS"] / 1024, "peak": kib["VmHWM"] / 1024}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smoke run: small inputs, one repetition")
    p.add_argument("--mib", type=int, default=256, help="MiB of blocks per quant type")
    p.add_argument("--weights", nargs="+", default=["float32", "int8", "int4"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--memory-of", help=argparse.SUPPRESS)  # the child of load_memory
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_of:
        memory_of(args.memory_of)
        return 0
    mib, reps = (4, 1) if args.quick else (args.mib, args.reps)
    per_type(mib << 20, reps)
    whole_loads(args.weights, reps)
    load_memory(args.weights)
    return 0


if __name__ == "__main__":
    sys.exit(main())
