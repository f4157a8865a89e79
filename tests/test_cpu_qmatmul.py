"""The CPU's block-quantized linears (kernels/cpu_qmatmul.cpp) against a float64 reference written
here from the definitions: activations rounded to int8 in blocks of 32 (scale = max |x| / 127 per
block, round half to even), weights dequantized from the plain int8 and int4 layouts (not the
packed ones under test). Both kernels are checked, the build's SIMD one (AVX-512 VNNI, AVX-VNNI or
AVX2: test_cpu_isa checks each build) and the portable one, and against each other: the same bits. Shapes cover 1 to 9 rows (every
register-tile height and a remainder), an odd number of 16-channel tiles, and SmolLM2's K."""

import pytest
import torch

from gpushare.kernels import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.loaded(), reason="the C++ kernels do not build here")

from gpushare.kernels import cpu_qmatmul  # noqa: E402
from gpushare.models.quantized import Int4Weight, quantize_int4, quantize_int8  # noqa: E402

SHAPES = [(48, 64), (960, 576), (576, 1536)]  # (N, K)
ROWS = [1, 2, 3, 4, 5, 9]
KERNELS = [False, True] if cpu_qmatmul.kernel() != "portable" else [True]  # portable?


def blocks_definition(x: torch.Tensor) -> torch.Tensor:
    """The activations as the kernel sees them, in float64: each block of 32 rounded to 255 levels,
    the code x * (127 / max) in float32 rounded half to even, the step max / 127."""
    blocks = x.view(x.shape[0], -1, 32)
    top = blocks.abs().amax(dim=-1, keepdim=True)
    codes = torch.where(top > 0, torch.round(blocks * (127 / torch.where(top > 0, top, 1))), 0)
    return (codes.double() * (top / 127).double()).view(x.shape)


def int8_definition(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return qweight.double() * scales.double()[:, None]


def int4_definition(w: Int4Weight) -> torch.Tensor:
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.float64)
    q[:, 0::2], q[:, 1::2] = (w.qweight & 15).double(), (w.qweight >> 4).double()
    groups = q.view(n, k // 32, 32)
    return (groups * w.scales.double()[..., None] + w.mins.double()[..., None]).view(n, k)


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out.double() - reference).abs().max() / reference.abs().max()).item()


def inputs(rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, k, generator=gen)
    x[:, 3] *= 2000  # an outlier channel, as SmolLM2's hidden states have: it coarsens its own block only
    x[0, 32:64] = 0  # an all-zero block
    return x


@pytest.mark.parametrize("portable", KERNELS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_int8_matches_the_definition(n, k, portable):
    gen = torch.Generator().manual_seed(n + k)
    w = quantize_int8(torch.randn(n, k, generator=gen) / 30)
    codes = cpu_qmatmul.pack_int8(w.qweight)
    for rows in ROWS:
        x = inputs(rows, k, gen)
        out = cpu_qmatmul.matmul(x, codes, w.scales, None, n, portable=portable)
        assert out.shape == (rows, n) and out.dtype == torch.float32
        assert relative_error(out, blocks_definition(x) @ int8_definition(w.qweight, w.scales).T) < 1e-5


@pytest.mark.parametrize("portable", KERNELS)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("groups", ["float32", "float16"])
def test_int4_matches_the_definition(n, k, portable, groups):
    gen = torch.Generator().manual_seed(n * k)
    w = quantize_int4(torch.randn(n, k, generator=gen) / 30)
    if groups == "float16":  # as GGUF's Q4_0 and Q4_1 store them: packed as float16, no rounding
        w = Int4Weight(w.qweight, w.scales.half().float(), w.mins.half().float(), 32)
    codes, scales, mins = cpu_qmatmul.pack_int4(w.nibbles(), w.scales, w.mins)
    assert scales.dtype == mins.dtype == getattr(torch, groups)
    for rows in ROWS:
        x = inputs(rows, k, gen)
        out = cpu_qmatmul.matmul(x, codes, scales, mins, n, portable=portable)
        assert relative_error(out, blocks_definition(x) @ int4_definition(w).T) < 1e-5


@pytest.mark.parametrize("bits", [8, 4])
def test_a_row_is_the_same_alone_in_any_batch_and_on_either_kernel(bits):
    gen = torch.Generator().manual_seed(bits)
    n, k = 80, 576  # five tiles: two pairs and one alone
    weight = torch.randn(n, k, generator=gen) / 30
    if bits == 8:
        w = quantize_int8(weight)
        args = (cpu_qmatmul.pack_int8(w.qweight), w.scales, None, n)
    else:
        w = quantize_int4(weight)
        args = (*cpu_qmatmul.pack_int4(w.nibbles(), w.scales, w.mins), n)
    x = inputs(11, k, gen)
    together = cpu_qmatmul.matmul(x, *args)
    for start, stop in [(0, 1), (3, 4), (2, 7), (5, 11)]:
        assert torch.equal(cpu_qmatmul.matmul(x[start:stop], *args), together[start:stop])
    assert torch.equal(cpu_qmatmul.matmul(x, *args, portable=True), together)
    assert torch.equal(cpu_qmatmul.matmul(x.view(1, 11, k), *args), together.view(1, 11, n))


def test_the_tied_embedding_reads_rows_back_from_the_packed_int8_weight():
    gen = torch.Generator().manual_seed(3)
    w = quantize_int8(torch.randn(64, 96, generator=gen))
    ids = torch.tensor([[0, 17], [63, 17]])
    rows = cpu_qmatmul.int8_rows(cpu_qmatmul.pack_int8(w.qweight), w.scales, 96, ids)
    assert torch.equal(rows, w.dequantize()[ids])
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_qmatmul.int8_rows(cpu_qmatmul.pack_int8(w.qweight), w.scales, 96, torch.tensor([64]))


def test_a_row_that_is_not_finite_gives_nan_in_that_row_only():
    gen = torch.Generator().manual_seed(5)
    w = quantize_int8(torch.randn(32, 64, generator=gen))
    codes = cpu_qmatmul.pack_int8(w.qweight)
    x = torch.randn(3, 64, generator=gen)
    x[1, 40] = float("inf")
    out = cpu_qmatmul.matmul(x, codes, w.scales, None, 32)
    assert out[1].isnan().all() and out[[0, 2]].isfinite().all()
    assert cpu_qmatmul.matmul(torch.empty(0, 64), codes, w.scales, None, 32).shape == (0, 32)


def test_shapes_the_kernel_cannot_take_are_refused_by_name():
    assert cpu_qmatmul.fits(960, 576) and not cpu_qmatmul.fits(960, 100) and not cpu_qmatmul.fits(20, 64)
    w = quantize_int8(torch.randn(32, 64))
    codes = cpu_qmatmul.pack_int8(w.qweight)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.gpushare.quantized_matmul(torch.randn(2, 48), codes[:32 * 48], w.scales, None, 32, 8, False)
    with pytest.raises(RuntimeError, match="do not hold"):
        cpu_qmatmul.matmul(torch.randn(2, 64), codes, w.scales, None, 48)
    with pytest.raises(RuntimeError, match="int4 needs scales and mins"):
        torch.ops.gpushare.quantized_matmul(torch.randn(2, 64), codes[:32 * 32], w.scales, None, 32, 4, False)
