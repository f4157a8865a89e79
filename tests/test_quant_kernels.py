"""Weight-only quantized matmul (int8 per row, int4 per group) against a float64 reference written here.

Both implementations are checked: the Triton kernels (run by Triton's interpreter on CPU,
``TRITON_INTERPRET=1``) and the torch path, each against a float64 matmul of the weight
dequantised here straight from the layout's definition (not by the helpers under test), and
the two against each other. Shapes cover decode batches (M = 1, 7, 16, 64), a prefill batch
spanning two row tiles, N that is not a multiple of the tile, and SmolLM2's K (576, 1536).
Every float buffer the functions allocate starts as NaN, so an unwritten element fails.
Error is max |out - ref| / max |ref|: <= 1e-5 for fp32, <= 1e-2 for fp16, <= 2e-2 for bf16
(weight and output are each rounded to bf16; the interpreter truncates where the GPU rounds).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest
import torch

from gpushare import kernels
from gpushare.kernels import quant_matmul_torch
from gpushare.kernels import quant_matmul_triton

TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# (M, N, K, dtype)
INT8_CASES = [(1, 40, 576, BF16), (7, 40, 1536, BF16), (64, 72, 576, BF16), (16, 40, 1536, FP16),
              (7, 40, 576, FP32), (130, 40, 576, BF16)]
# (M, N, K, group_size, dtype)
INT4_CASES = [(1, 40, 576, 32, BF16), (7, 40, 1536, 128, BF16), (64, 72, 1536, 32, BF16),
              (16, 40, 576, 32, FP16), (7, 40, 1536, 128, FP32), (130, 40, 576, 64, BF16)]


def case_id(case):
    return "-".join(str(v).removeprefix("torch.") for v in case)


def int8_weight(gen, n, k):
    qweight = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, generator=gen) / 64 + 1e-3
    return qweight, scales


def int8_definition(qweight, scales):
    """float64 ``w[n, k] = qweight[n, k] * scales[n]``."""
    return qweight.double() * scales.double()[:, None]


def int4_weight(gen, n, k, group_size):
    qweight = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, k // group_size, generator=gen) / 16 + 1e-3
    mins = -8 * scales * torch.rand(n, k // group_size, generator=gen)  # as in Q4_1: around -8 scales
    return qweight, scales, mins


def int4_definition(qweight, scales, mins, group_size):
    """float64 ``w[n, k] = q[n, k] * scales[n, k // g] + mins[n, k // g]``; byte j holds k = 2j (low), 2j + 1."""
    n, half_k = qweight.shape
    q = torch.zeros(n, 2 * half_k, dtype=torch.float64)
    q[:, 0::2] = (qweight % 16).double()
    q[:, 1::2] = (qweight // 16).double()
    return q * scales.double().repeat_interleave(group_size, 1) + mins.double().repeat_interleave(group_size, 1)


def relative_error(out, ref):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def assert_close(out, ref, dtype, shape):
    assert out.dtype == dtype and out.shape == shape
    assert not out.isnan().any(), "unwritten or NaN-polluted output elements"
    assert relative_error(out, ref) <= TOLERANCE[dtype]


INT8_IMPLS = (quant_matmul_triton.int8_weight_matmul, quant_matmul_torch.int8_weight_matmul)
INT4_IMPLS = (quant_matmul_triton.int4_weight_matmul, quant_matmul_torch.int4_weight_matmul)


def check_both_paths(impls, x, weight_args, weight64):
    """The Triton and torch paths, each against float64 and against each other."""
    ref = x.double() @ weight64.T
    shape = (*x.shape[:-1], weight64.shape[0])
    triton_out, torch_out = (impl(x, *weight_args) for impl in impls)
    assert_close(triton_out, ref, x.dtype, shape)
    assert_close(torch_out, ref, x.dtype, shape)
    assert relative_error(triton_out, torch_out) <= TOLERANCE[x.dtype]


def check_int8(m, n, k, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    qweight, scales = int8_weight(gen, n, k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    check_both_paths(INT8_IMPLS, x, (qweight, scales), int8_definition(qweight, scales))


def check_int4(m, n, k, group_size, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = int4_weight(gen, n, k, group_size)
    x = torch.randn(m, k, generator=gen).to(dtype)
    check_both_paths(INT4_IMPLS, x, (*weight, group_size), int4_definition(*weight, group_size))


@pytest.fixture
def small_tiles(monkeypatch):
    """16 x 16 output tiles and 64-wide K tiles for every M: many programs in both dimensions,
    and int4 tiles both inside one group (group 128) and across two (group 32)."""
    monkeypatch.setattr(quant_matmul_triton, "TILE_CONFIGS", [(1 << 62, 16, 16, 64, 4, 1)])


@pytest.mark.usefixtures("nan_allocations")
@pytest.mark.parametrize("m, n, k, dtype", INT8_CASES, ids=map(case_id, INT8_CASES))
def test_int8_matmul_matches_reference(m, n, k, dtype):
    check_int8(m, n, k, dtype, seed=m + k)


@pytest.mark.usefixtures("nan_allocations")
@pytest.mark.parametrize("m, n, k, group_size, dtype", INT4_CASES, ids=map(case_id, INT4_CASES))
def test_int4_matmul_matches_reference(m, n, k, group_size, dtype):
    check_int4(m, n, k, group_size, dtype, seed=m + k + group_size)


@pytest.mark.usefixtures("nan_allocations", "small_tiles")
def test_int8_matmul_over_many_tiles():
    check_int8(40, 50, 576, FP32, seed=1)


@pytest.mark.usefixtures("nan_allocations", "small_tiles")
@pytest.mark.parametrize("group_size", [32, 128])
def test_int4_matmul_over_many_tiles(group_size):
    check_int4(40, 50, 1536, group_size, FP32, seed=group_size)


@pytest.mark.usefixtures("nan_allocations")
@pytest.mark.parametrize("impls", [INT8_IMPLS, INT4_IMPLS], ids=["int8", "int4"])
def test_activations_with_leading_dims_and_strided_rows(impls):
    # Rows of a wider buffer (the slice of a fused projection's output), batch x tokens x K.
    gen = torch.Generator().manual_seed(3)
    k, n, group_size = 576, 24, 32
    x = torch.randn(2, 3, k + 64, generator=gen).to(BF16)[..., 64:]
    if impls is INT8_IMPLS:
        weight_args = int8_weight(gen, n, k)
        weight64 = int8_definition(*weight_args)
    else:
        weight = int4_weight(gen, n, k, group_size)
        weight_args, weight64 = (*weight, group_size), int4_definition(*weight, group_size)
    check_both_paths(impls, x, weight_args, weight64)


def test_dequantize_helpers_follow_the_layouts():
    gen = torch.Generator().manual_seed(4)
    qweight, scales = int8_weight(gen, 8, 64)
    torch.testing.assert_close(quant_matmul_torch.dequantize_int8(qweight, scales).double(),
                               int8_definition(qweight, scales), rtol=1e-6, atol=0)
    weight = int4_weight(gen, 8, 128, 32)
    torch.testing.assert_close(quant_matmul_torch.dequantize_int4(*weight, 32).double(),
                               int4_definition(*weight, 32), rtol=1e-6, atol=1e-7)
    assert quant_matmul_torch.dequantize_int4(*weight, 32, dtype=BF16).dtype == BF16


def test_dispatch_picks_triton_for_cuda_or_when_forced(monkeypatch):
    x = torch.randn(3, 64)
    gen = torch.Generator().manual_seed(5)
    int8_args, int4_args = int8_weight(gen, 8, 64), (*int4_weight(gen, 8, 64, 32), 32)
    monkeypatch.delenv("GPUSHARE_KERNELS", raising=False)
    assert kernels._ops(x, quant_matmul_torch) is quant_matmul_torch  # CPU tensors: the torch path
    assert torch.equal(kernels.int8_weight_matmul(x, *int8_args), quant_matmul_torch.int8_weight_matmul(x, *int8_args))
    monkeypatch.setenv("GPUSHARE_KERNELS", "triton")
    assert kernels._ops(x, quant_matmul_torch) is quant_matmul_triton
    assert torch.equal(kernels.int4_weight_matmul(x, *int4_args), quant_matmul_triton.int4_weight_matmul(x, *int4_args))
