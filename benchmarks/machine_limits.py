"""This machine's two limits for CPU decoding, and the serving figures they bound.

    .venv/bin/python benchmarks/machine_limits.py                 # SmolLM2 int4, 2 threads

- Memory bandwidth: the best of several reads of a 2 GiB buffer (torch's sum over it, all threads).
  At batch 1 every decode step reads the weights once, so bandwidth / weight bytes is the c=1
  ceiling in tokens/s (KV and activations are small beside the weights at short context).
- int8 compute: the best of several 2048^3 int8 matrix products through torch._int_mm (oneDNN's
  VNNI kernels, int32 accumulation). A token costs 2 x (parameters in the linears) int8 operations,
  so that peak / cost is the ceiling for large batches, where the weights are read once per step
  for every stream at once.

The weight bytes and linear parameters are the served model's (`gpushare.LLM` loads it with the
default `auto` weights). Run it with nothing else on the machine.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from perplexity import find_gguf  # noqa: E402


def read_bandwidth_gb_s(buffer_bytes: int, repeats: int) -> float:
    buf = torch.ones(buffer_bytes // 4, dtype=torch.float32)
    best_s = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best_s = min(best_s, time.perf_counter() - t0)
    return buffer_bytes / best_s / 1e9


def int8_peak_gops(n: int, repeats: int) -> float:
    a = torch.randint(-64, 64, (n, n), dtype=torch.int8)
    b = torch.randint(-64, 64, (n, n), dtype=torch.int8)
    torch._int_mm(a, b)
    best_s = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch._int_mm(a, b)
        best_s = min(best_s, time.perf_counter() - t0)
    return 2 * n ** 3 / best_s / 1e9


def model_sizes(gguf: str) -> tuple[int, int, str]:
    """(bytes a decode step reads, parameters in the linears, their kernels) of the served model: the
    linears' stored tensors (codes and scales, the tied lm_head's included), the norms being small."""
    from gpushare import LLM
    from gpushare.models.linear import Linear
    from gpushare.models.loader import linear_kernels

    llm = LLM(gguf)
    try:
        step_bytes = linear_params = 0
        for module in llm.model.model.modules():
            if isinstance(module, Linear):
                tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
                step_bytes += sum(t.numel() * t.element_size() for t in tensors)
                linear_params += module.in_features * module.out_features
        return step_bytes, linear_params, linear_kernels(llm.model.model)
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--buffer-mib", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    gb_s = read_bandwidth_gb_s(args.buffer_mib << 20, args.repeats)
    gops = int8_peak_gops(2048, args.repeats)
    step_bytes, linear_params, fmt = model_sizes(find_gguf())
    print(f"threads {args.threads}: read bandwidth {gb_s:.1f} GB/s, int8 peak {gops:.0f} GOPS (torch._int_mm 2048^3)")
    print(f"model (default weights, kernels {fmt}): {step_bytes / 2**20:.1f} MiB read per decode step, {linear_params / 1e6:.1f} M linear parameters")
    print(f"c=1 ceiling (bandwidth / weight bytes): {gb_s * 1e9 / step_bytes:.0f} tok/s")
    print(f"large-batch ceiling (int8 peak / 2 x linear parameters): {gops * 1e9 / (2 * linear_params):.0f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
