"""Weight-only quantized matmul as Triton kernels: the GPU path behind ``gpushare.kernels``.

Same functions, shapes and weight layouts as ``quant_matmul_torch`` (see its docstring):
``y [M, N] = x [M, K] @ w.T`` with ``w [N, K]`` stored as int8 with per-row scales, or as
packed int4 nibbles with per-group scales and mins. Each program computes one
``BLOCK_M x BLOCK_N`` tile of ``y``, streaming the quantized weight through K once.

Numerics: accumulation is fp32. int8 weights enter the dot as exact integers (int8 values
are exact in bf16 and fp16) and the per-row scale multiplies the fp32 sum at the end. int4
weights are dequantised in fp32 (``q * scale + min``) and rounded to the activation dtype
for the dot, as the torch reference does. On GPU, bf16/fp16 activations use the tensor-core
dot of that dtype; fp32 activations use exact ("ieee") fp32 dots. Under
``TRITON_INTERPRET=1`` every dot runs in fp32 (the interpreter's bf16 dots and int8 -> bf16
casts are wrong) on the same rounded operands, and fp32 -> bf16 casts truncate where the
GPU rounds to nearest, so the interpreter checks the logic, not the last bf16 bit.

Tiles: decode batches (M <= 64) are bound by reading the weight, so they get narrow N tiles
(enough programs for every SM even at N = 4096) and long K tiles in deep pipelines (enough
bytes in flight); larger M gets the usual square tiles. The tile is picked from M by a
fixed table rather than ``triton.autotune``: the engine sees dozens of distinct M per model,
the interpreter cannot benchmark, and ``benchmarks/gpu_check.py`` sweeps the table's
candidates on a real GPU. The K order of the fp32 sum (k16 tensor-core steps, in order) does
not depend on the tile, so a row's result should not depend on its batch neighbours;
gpu_check verifies that bit for bit.

int4: a tile's bytes hold even k in low nibbles and odd k in high nibbles, so the x tile
is split into its even and odd columns (one contiguous load, split in registers) and two
dots are accumulated. The weight tile is dequantised as [groups in the tile, bytes per group,
BLOCK_N], so each group's scale and min is loaded once per column and broadcast.
"""

import functools

import torch
import triton
import triton.language as tl

# (max_m, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the first row with M <= max_m
# runs. Module level so tests can shrink it to exercise several tiles in both dimensions.
TILE_CONFIGS = [
    (16, 16, 32, 256, 4, 4),
    (32, 32, 32, 256, 4, 4),
    (64, 64, 64, 128, 4, 4),
    (1 << 62, 128, 128, 64, 8, 3),
]
# float32 activations double the x tile and make the dot's operands float32: those pipelines need
# up to 152 KiB of shared memory a block (docs/benchmarks.md), more than the 99 KiB of the
# workstation cards (sm_86, sm_89). Where a block has less than this, they run FP32_SMALL_STAGES deep.
FP32_FULL_STAGES_SHARED_BYTES = 160 * 1024
FP32_SMALL_STAGES = 2


def tile_config(m: int, dtype: torch.dtype = torch.bfloat16, shared_bytes: int | None = None):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for a batch of ``m`` rows of ``dtype``
    on a GPU with ``shared_bytes`` of shared memory a block (None: the table as it stands)."""
    for max_m, *config in TILE_CONFIGS:
        if m <= max_m:
            if dtype == torch.float32 and shared_bytes is not None and shared_bytes < FP32_FULL_STAGES_SHARED_BYTES:
                config[-1] = min(config[-1], FP32_SMALL_STAGES)
            return tuple(config)
    raise ValueError(f"no tile config for M = {m}")


def tile_buckets() -> list[int]:
    """One batch size for each row of TILE_CONFIGS: the M that reach a distinct compiled kernel
    (M itself is not specialised), for warming every one up (models/triton_warmup.py)."""
    sizes, previous = [], 0
    for max_m, *_ in TILE_CONFIGS:
        sizes.append(min(max_m, previous + 64))
        previous = max_m
    return sizes


@functools.cache
def _shared_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def shared_bytes_per_block(device: torch.device) -> int | None:
    """The shared memory a block may opt in to on ``device``; None off CUDA (the interpreter)."""
    return _shared_bytes(device) if device.type == "cuda" else None


def _dot_mode(dtype: torch.dtype):
    """(UPCAST, PRECISION): fp32 dots for fp32 activations and under the interpreter."""
    if dtype == torch.float32 or triton.knobs.runtime.interpret:
        return True, "ieee"
    return False, "tf32"  # ignored for bf16/fp16 operands


@triton.jit
def _dot(acc, x, w, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``acc + x @ w`` for ``w`` already in ``x``'s dtype."""
    if UPCAST:
        x = x.to(tl.float32)
        w = w.to(tl.float32)
    return tl.dot(x, w, acc, input_precision=PRECISION)


# M changes with every step's batch: not specialised (no variant for M = 1 or multiples of 16 to
# compile mid-serving); the tile config is the bucket.
@triton.jit(do_not_specialize=["M"])
def _int8_matmul_kernel(
    x_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
    w_ptr, scales_ptr, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        q = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0)
        acc = _dot(acc, x, q.to(tl.float32).to(x.dtype), UPCAST, PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    scales = tl.load(scales_ptr + cols, mask=col_ok, other=0.0)
    y = acc * scales[None, :]
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _int4_matmul_kernel(
    x_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
    w_ptr, scales_ptr, mins_ptr, stride_wn, stride_sn,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    HALF_K: tl.constexpr = BLOCK_K // 2
    # A tile starts at a multiple of BLOCK_K and holds TILE_GROUPS groups (one when it is
    # narrower than a group, which then holds it whole): both are powers of two.
    TILE_GROUPS: tl.constexpr = (BLOCK_K + GROUP_SIZE - 1) // GROUP_SIZE
    SPAN: tl.constexpr = HALF_K // TILE_GROUPS  # bytes of one row per group in the tile
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    groups = tl.arange(0, TILE_GROUPS)[:, None, None]
    cols3 = cols[None, None, :]
    byte_cols = groups * SPAN + tl.arange(0, SPAN)[None, :, None]  # k = 2j (low nibble), 2j + 1 (high)
    row_ok = rows < M
    col_ok = cols3 < N
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
    # The weight tile is [TILE_GROUPS, SPAN, BLOCK_N] so that its scales and mins load as
    # [TILE_GROUPS, 1, BLOCK_N] and broadcast, rather than one load per weight byte.
    w_ptrs = w_ptr + cols3.to(tl.int64) * stride_wn + byte_cols
    group_offs = cols3.to(tl.int64) * stride_sn + groups
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=row_ok[:, None] & (ks[None, :] < K - k0), other=0.0)
        x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, HALF_K, 2)))
        packed = tl.load(w_ptrs, mask=(2 * byte_cols < K - k0) & col_ok, other=0)
        group_mask = (groups * GROUP_SIZE < K - k0) & col_ok
        scales = tl.load(scales_ptr + group_offs + k0 // GROUP_SIZE, mask=group_mask, other=0.0)
        mins = tl.load(mins_ptr + group_offs + k0 // GROUP_SIZE, mask=group_mask, other=0.0)
        low = ((packed & 0xF).to(tl.float32) * scales + mins).to(x.dtype)
        high = ((packed >> 4).to(tl.float32) * scales + mins).to(x.dtype)
        acc = _dot(acc, x_even, tl.reshape(low, (HALF_K, BLOCK_N)), UPCAST, PRECISION)
        acc = _dot(acc, x_odd, tl.reshape(high, (HALF_K, BLOCK_N)), UPCAST, PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += HALF_K
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (cols[None, :] < N))


def _launch(kernel, x, n, weight_args, **constexprs):
    """Run ``kernel`` over ``x [..., K]`` into a new ``[..., n]`` output of ``x``'s dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.view(*lead, n)
    block_m, block_n, block_k, num_warps, num_stages = tile_config(m, x.dtype, shared_bytes_per_block(x.device))
    upcast, precision = _dot_mode(x.dtype)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    kernel[grid](
        x2, y, m, n, k, x2.stride(0), y.stride(0), *weight_args,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast, PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages, **constexprs,
    )
    return y.view(*lead, n)


def int8_weight_matmul(x, qweight, scales):
    """``x [..., K]`` times the int8 weight ``[N, K]`` transposed: ``[..., N]`` in ``x.dtype``."""
    n, k = qweight.shape
    assert x.shape[-1] == k and scales.shape == (n,), (x.shape, qweight.shape, scales.shape)
    assert qweight.stride(-1) == 1 and scales.stride(0) == 1
    return _launch(_int8_matmul_kernel, x, n, (qweight, scales, qweight.stride(0)))


def int4_weight_matmul(x, qweight, scales, mins, group_size):
    """``x [..., K]`` times the int4 weight ``[N, K]`` transposed: ``[..., N]`` in ``x.dtype``."""
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    assert x.shape[-1] == k and scales.shape == mins.shape == (n, k // group_size), \
        (x.shape, qweight.shape, scales.shape, mins.shape, group_size)
    assert group_size >= 2 and group_size & (group_size - 1) == 0 and k % group_size == 0, \
        f"group_size {group_size} must be a power of two dividing K = {k}"
    assert qweight.stride(-1) == 1 and scales.stride() == mins.stride() and scales.stride(-1) == 1
    return _launch(_int4_matmul_kernel, x, n, (qweight, scales, mins, qweight.stride(0), scales.stride(0)),
                   GROUP_SIZE=group_size)
