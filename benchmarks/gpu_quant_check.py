"""The ``quant`` part of benchmarks/gpu_check.py: the int8 / int4 weight-only matmul kernels on CUDA:
correctness against the torch path, whether a row's result is bit-identical alone and inside a batch,
a sweep of tile candidates for decode batches, and time at M = 1, 16, 64 (GB/s of weight read) and
512 (TFLOP/s) beside a bf16 ``F.linear``."""

import torch

from gpu_check_common import DEVICE, DRY, TOLERANCE, against, cuda_time_s, kernel_module, nominal_peaks, relative_error

# Quantized matmul: (M, N, K, group_size) checked in every dtype; weights [N, K] timed (Llama-3-8B's
# attention output, MLP up and MLP down) at decode batches and one prefill batch; tile candidates
# (BLOCK_N, BLOCK_K, num_warps, num_stages) swept for each decode BLOCK_M on the first weight.
QUANT_CHECKS = [(1, 1000, 1536, 32), (7, 1000, 576, 32), (64, 1000, 1536, 128), (300, 1000, 4096, 128)]
QUANT_WEIGHTS = [(4096, 4096), (14336, 4096), (4096, 14336)]
QUANT_BATCHES = [1, 16, 64]
QUANT_PREFILL_BATCH = 512  # timed only: says whether prefill should rather dequantise and call cuBLAS
QUANT_TIME_GROUP = 32  # GGUF Q4_0/Q4_1 group size: what the loader makes of Ollama's usual files
QUANT_TILE_CANDIDATES = [(16, 256, 4, 4), (32, 256, 4, 4), (32, 128, 4, 4), (64, 128, 4, 4), (64, 256, 8, 3)]
ITERS = 50
if DRY:  # the interpreter runs every program in Python: the same calls on tiny shapes
    QUANT_CHECKS, QUANT_WEIGHTS = [(1, 64, 256, 32), (7, 64, 256, 128)], [(64, 256)]
    QUANT_BATCHES, QUANT_PREFILL_BATCH, QUANT_TILE_CANDIDATES = [1], 16, QUANT_TILE_CANDIDATES[:1]
    ITERS = 1


def quant_weights(n, k, group_size, gen):
    """Random int8 (qweight, scales) and int4 (qweight, scales, mins) weights ``[N, K]`` on the device."""
    int8 = (torch.randint(-127, 128, (n, k), generator=gen, device=DEVICE, dtype=torch.int8),
            torch.rand(n, generator=gen, device=DEVICE) / 64)
    groups = k // group_size
    scales = torch.rand(n, groups, generator=gen, device=DEVICE) / 16
    int4 = (torch.randint(0, 256, (n, k // 2), generator=gen, device=DEVICE, dtype=torch.uint8),
            scales, -8 * scales * torch.rand(n, groups, generator=gen, device=DEVICE))
    return int8, int4


def part_quant_matmul(report):
    ref_ops, tri_ops = kernel_module("quant_matmul_torch"), kernel_module("quant_matmul_triton")
    gen = torch.Generator(device=DEVICE).manual_seed(2)

    report.line("  correctness (vs the torch path on fp32 copies) and batch invariance (rows alone vs in the batch):")
    for m, n, k, group_size in QUANT_CHECKS:
        int8, int4 = quant_weights(n, k, group_size, gen)
        for dtype in TOLERANCE:
            x = torch.randn(m, k, generator=gen, device=DEVICE).to(dtype)
            for name, fn, weight in (("int8", "int8_weight_matmul", int8),
                                     ("int4", "int4_weight_matmul", (*int4, group_size))):
                try:
                    out = getattr(tri_ops, fn)(x, *weight)
                    err = relative_error(out, getattr(ref_ops, fn)(x.float(), *weight))
                    alone = torch.cat([getattr(tri_ops, fn)(x[i:i + 1], *weight) for i in range(min(m, 8))])
                    invariant = torch.equal(alone, out[:len(alone)])
                    same = "rows bit-identical" if invariant else \
                        f"rows DIFFER alone (max {(alone.float() - out[:len(alone)].float()).abs().max():.1e})"
                    # batch invariance is the kernel's promise on a GPU; under the interpreter (dots in
                    # numpy) float32 rows were seen to differ in their last bits, so there it is reported only
                    verdict = report.verdict(err <= TOLERANCE[dtype] and not out.isnan().any()
                                             and (invariant or DRY))
                    report.line(f"  {name} {str(dtype)[6:]:9s} M={m:<4d} N={n} K={k:<5d} g={group_size:<4d} "
                                f"err={err:.2e} (tol {TOLERANCE[dtype]:.0e}) {same} {verdict}")
                except Exception as e:  # one broken check must not hide the others
                    report.verdict(False)
                    report.line(f"  {name} {dtype} M={m} N={n} K={k}: ERROR {type(e).__name__}: {e}")

    n, k = QUANT_WEIGHTS[0]
    int8, int4 = quant_weights(n, k, QUANT_TIME_GROUP, gen)
    report.line(f"  tile sweep, weight {n}x{k}, bf16 (ms per call; * marks the table's choice):")
    defaults = tri_ops.TILE_CONFIGS
    try:
        for m in QUANT_BATCHES:
            x = torch.randn(m, k, generator=gen, device=DEVICE).to(torch.bfloat16)
            block_m, *chosen = tri_ops.tile_config(m, x.dtype, tri_ops.shared_bytes_per_block(x.device))
            for name, fn, weight in (("int8", tri_ops.int8_weight_matmul, int8),
                                     ("int4", tri_ops.int4_weight_matmul, (*int4, QUANT_TIME_GROUP))):
                cells = []
                for candidate in QUANT_TILE_CANDIDATES:
                    tri_ops.TILE_CONFIGS = [(1 << 62, block_m, *candidate)]
                    ms = cuda_time_s(lambda: fn(x, *weight), ITERS) * 1e3
                    cells.append(f"{candidate}{'*' if list(candidate) == chosen else ''} {ms:.4f}")
                report.line(f"    M={m:<3d} {name}: " + "; ".join(cells))
    finally:
        tri_ops.TILE_CONFIGS = defaults

    tflops_peak, gbps_peak = nominal_peaks()
    report.line("  time per call vs bf16 F.linear (GB/s = weight bytes read / time; TFLOP/s at the prefill batch"
                f"{f'; nominal peaks {gbps_peak:.0f} GB/s, {tflops_peak:.0f} TFLOP/s' if gbps_peak else ''}):")
    timed = report.data.setdefault("quant_matmul", [])
    for n, k in QUANT_WEIGHTS:
        int8, int4 = quant_weights(n, k, QUANT_TIME_GROUP, gen)
        dense = ref_ops.dequantize_int8(*int8, torch.bfloat16)
        for m in [*QUANT_BATCHES, QUANT_PREFILL_BATCH]:
            x = torch.randn(m, k, generator=gen, device=DEVICE).to(torch.bfloat16)
            cells = []
            for name, fn, args in (("bf16", torch.nn.functional.linear, (dense,)),
                                   ("int8", tri_ops.int8_weight_matmul, int8),
                                   ("int4", tri_ops.int4_weight_matmul, (*int4, QUANT_TIME_GROUP))):
                seconds = cuda_time_s(lambda: fn(x, *args), ITERS)
                weight_bytes = sum(t.numel() * t.element_size() for t in args if torch.is_tensor(t))
                gbps, tflops = weight_bytes / seconds / 1e9, 2 * m * n * k / seconds / 1e12
                timed.append({"kind": name, "n": n, "k": k, "m": m, "us": seconds * 1e6, "gbps": gbps,
                              "tflops": tflops})
                figure = (against(tflops, tflops_peak, "TFLOP/s") if m == QUANT_PREFILL_BATCH
                          else against(gbps, gbps_peak, "GB/s"))
                cells.append(f"{name} {seconds * 1e6:7.1f} us {figure}")
            report.line(f"    {n:5d}x{k:<5d} M={m:<3d} " + " | ".join(cells))
        del dense
