"""Batched LoRA as one Triton kernel: the GPU path behind ``gpushare.kernels.lora_apply``.

Same function and layout as ``lora_torch`` (see its docstring). A gathered shrink-then-expand (as
S-LoRA's and Punica's): the grid is (row, output tile); each program loads its row's slot, computes
``x[t] . A[s]ᵀ`` over the rank (BLOCK_K columns of x at a time) and then that ``· B[s]`` (stored
transposed, ``[rank, out]``: a tile's columns are contiguous) for its BLOCK_N output columns,
scales and adds it to ``y``. Rows of slot -1 load and store nothing. The shrink is redone by each
of a row's output tiles: rank x in multiply-adds, traded for a second launch and a round trip of
the shrunk rows through memory. Not yet run on a GPU, only under the
interpreter: the trade and the tile sizes are a first guess, untimed.

``y`` may be a column slice of a wider tensor (its row stride is passed), so the fused projections'
outputs take adapters in place. Numerics as the reference: float32 or bfloat16 stacks widened as
they load, fp32 sums, the delta rounded to ``y``'s dtype before the add.
"""

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # output columns per program
BLOCK_K = 128  # input columns per step of the shrink


# An adapter's rank is not specialised (no variant for rank 1 or multiples of 16); BLOCK_R buckets it.
@triton.jit(do_not_specialize=["rank"])
def _lora_kernel(y_ptr, x_ptr, a_ptr, b_ptr, slot_ptr, scale_ptr, out_features, in_features, rank,
                 y_row_stride, x_row_stride, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    slot = tl.load(slot_ptr + row)
    # a base row (slot -1) gets empty column ranges: it loads and stores nothing
    in_limit = tl.where(slot >= 0, in_features, 0)
    out_limit = tl.where(slot >= 0, out_features, 0)
    slot = tl.maximum(slot, 0).to(tl.int64)
    ranks = tl.arange(0, BLOCK_R)
    rank_ok = ranks < rank

    shrunk = tl.zeros([BLOCK_R], dtype=tl.float32)
    a_slot = a_ptr + slot * rank * in_features
    for k0 in range(0, in_limit, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < in_limit
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=col_ok, other=0.0).to(tl.float32)
        a = tl.load(a_slot + ranks[:, None] * in_features + cols[None, :], mask=rank_ok[:, None] & col_ok[None, :],
                    other=0.0).to(tl.float32)
        shrunk += tl.sum(a * x[None, :], axis=1)

    outs = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ok = outs < out_limit
    b = tl.load(b_ptr + (slot * rank + ranks[:, None]) * out_features + outs[None, :],
                mask=rank_ok[:, None] & out_ok[None, :], other=0.0).to(tl.float32)
    delta = tl.load(scale_ptr + slot) * tl.sum(b * shrunk[:, None], axis=0)
    y_at = y_ptr + row * y_row_stride + outs
    y = tl.load(y_at, mask=out_ok, other=0.0)
    tl.store(y_at, (y.to(tl.float32) + delta.to(y.dtype).to(tl.float32)).to(y.dtype), mask=out_ok)


def lora_apply(y, x, a_stack, b_stack, slot_of_row, scale_of_slot):
    """Add each row's adapter product to ``y [rows, out]`` in place (columns contiguous, any row
    stride), from ``x [rows, in]``."""
    rows, out_features = y.shape
    slots, rank, in_features = a_stack.shape
    if rows == 0 or rank == 0:
        return y
    assert y.stride(1) == 1, "y's columns must be contiguous"
    x = x if x.stride(1) == 1 else x.contiguous()
    grid = (rows, triton.cdiv(out_features, BLOCK_N))
    _lora_kernel[grid](y, x, a_stack.contiguous(), b_stack.contiguous(), slot_of_row.to(torch.int32).contiguous(),
                       scale_of_slot.to(torch.float32).contiguous(), out_features, in_features, rank, y.stride(0),
                       x.stride(0), BLOCK_R=max(16, triton.next_power_of_2(rank)), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return y
