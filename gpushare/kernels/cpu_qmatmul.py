"""The CPU's quantized linears (``cpu_qmatmul.cpp``): int8 or int4 weights against activations
quantized to int8 in blocks of 32, one scale per block (as llama.cpp's Q8 dot products).

``pack_int8`` and ``pack_int4`` lay a weight out for the kernel once, at load; ``matmul`` runs it on
float32 rows. The packed form replaces the plain one (no second copy of the weight), so the int8
embedding lookup of a tied lm_head reads its rows back from it (``int8_rows``). Shapes the kernel
cannot take (K not a multiple of 32, N not of 16) are for the caller to route elsewhere
(``fits``).
"""

import torch

BLOCK = 32  # K elements per activation scale and per int4 weight group
LANES = 16  # output channels per tile


def fits(out_features: int, in_features: int) -> bool:
    return out_features % LANES == 0 and in_features % BLOCK == 0


def pack_int8(qweight: torch.Tensor) -> torch.Tensor:
    """int8 ``[N, K]`` -> uint8 ``[N/16, K/4, 16, 4]`` (flat), each code + 128: flipping the sign bit of
    a two's-complement byte adds 128, in place on the one copy the new layout needs."""
    n, k = qweight.shape
    tiles = qweight.view(torch.uint8).view(n // LANES, LANES, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    return tiles.bitwise_xor_(0x80).view(-1)


def int8_rows(codes: torch.Tensor, scales: torch.Tensor, in_features: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a ``pack_int8`` weight, dequantized to float32: the tied embedding's lookup."""
    return torch.ops.gpushare.int8_rows(codes, scales, in_features, ids.long())


def pack_int4(nibbles: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Codes ``nibbles [N, K]`` (0..15) with per-group ``scales``/``mins [N, K/32]`` -> the kernel's
    (codes uint8 ``[N/16, K/32, 4, 16, 4]`` flat, scales and mins ``[N/16, K/32, 16]``, float16 where
    that holds every one of them exactly, else float32)."""
    n, k = nibbles.shape
    # k = 32 b + 16 h + 4 v + i: h picks the nibble, v the vector, i the byte within a lane
    q = nibbles.to(torch.uint8).view(n // LANES, LANES, k // BLOCK, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)
    codes = (q[..., 0] | (q[..., 1] << 4)).contiguous().view(-1)

    def by_tile(groups: torch.Tensor) -> torch.Tensor:
        return groups.view(n // LANES, LANES, k // BLOCK).transpose(1, 2).contiguous()

    scales, mins = scales.float(), mins.float()
    if torch.equal(scales.half().float(), scales) and torch.equal(mins.half().float(), mins):
        scales, mins = scales.half(), mins.half()  # exact (GGUF's Q4_0 and Q4_1 blocks hold float16): half the bytes
    return codes, by_tile(scales), by_tile(mins)


def matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, out_features: int,
           portable: bool = False) -> torch.Tensor:
    """float32 ``x [..., K] @ w.T``: int8 weights when ``mins`` is None, int4 otherwise. ``portable``
    runs the portable kernel where the build has a SIMD one (the same numbers; for tests and timing)."""
    rows = x.reshape(-1, x.shape[-1])
    bits = 8 if mins is None else 4
    y = torch.ops.gpushare.quantized_matmul(rows, codes, scales, mins, out_features, bits, portable)
    return y.view(*x.shape[:-1], out_features)


def kernel() -> str:
    """The build's block kernel (kernels/cpu_ops.py picks its ISA): "avx512-vnni", "avx-vnni", "avx2"
    or "portable" (only the portable loop)."""
    return torch.ops.gpushare.quantized_matmul_kernel()
