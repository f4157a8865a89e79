"""The wide prefill path of int8 weights on torch's CPU kernel: wide rows through a bfloat16 GEMM on
the weight dequantized tile by tile, the other rows through the decode kernel.

A plain function of tensors, so that cpu_kernels can time it on a stack of matrices without
building ``Linear`` layers (which choose their kernel from cpu_kernels' verdicts).
"""

import threading

import torch
import torch.nn.functional as F

WIDE_TILE_ELEMENTS = 1 << 22  # a dequantized tile of an int8 weight: 8 MiB of bfloat16
WIDE_ROW_BLOCK = 64  # rows per bfloat16 GEMM of wide prefill rows: one kernel path whatever the row count
_scratch = threading.local()  # per engine thread: the tile's buffer, reused by every call


def int8_wide_matmul(x: torch.Tensor, qweight: torch.Tensor, scales_bf16: torch.Tensor, wide_rows: int) -> torch.Tensor:
    """bfloat16 ``x``'s wide rows ``[0, wide_rows)`` times the int8 ``qweight`` (one bfloat16 scale per
    output channel), dequantized a tile of output channels at a time into the thread's scratch (a
    fresh multi-MB tensor per call costs its page faults: 778 against 194 us for a 960 x 576 weight
    at 64 rows); the other rows through the decode kernel. A row's result does not depend on how many
    rows there are: the GEMM always runs on blocks of ``WIDE_ROW_BLOCK`` rows (the last one padded),
    since oneDNN's bfloat16 kernels pick their path by the row count (on an AMX CPU 16 rows gave
    other bits than 300)."""
    n, k = qweight.shape
    rows = x[:wide_rows]
    padding = -wide_rows % WIDE_ROW_BLOCK
    if padding:
        rows = torch.cat([rows, rows.new_zeros(padding, k)])
    tile = min(n, max(1, WIDE_TILE_ELEMENTS // k))
    scratch = getattr(_scratch, "tile", None)
    if scratch is None or scratch.numel() < tile * k:
        scratch = _scratch.tile = torch.empty(tile * k, dtype=torch.bfloat16)  # host: a CPU kernel's scratch
    parts = []
    for start in range(0, n, tile):
        end = min(n, start + tile)
        weight = torch.mul(qweight[start:end], scales_bf16[start:end, None],
                           out=scratch[:(end - start) * k].view(end - start, k))
        parts.append(torch.cat([F.linear(block, weight) for block in rows.split(WIDE_ROW_BLOCK)]))
    wide = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))[:wide_rows]
    if wide_rows == x.shape[0]:
        return wide
    return torch.cat([wide, torch.ops.aten._weight_int8pack_mm(x[wide_rows:], qweight, scales_bf16)])
