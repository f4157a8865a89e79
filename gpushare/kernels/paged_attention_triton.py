"""Paged attention as Triton kernels: the GPU path behind ``gpushare.kernels``.

Same functions, shapes and cache layout as ``paged_attention_torch``: ``k_cache`` and
``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``, token ``t`` of a
sequence lives in block ``block_table[t // block_size]`` at offset ``t % block_size``.

Numerics: every loaded value is converted to fp32 and accumulated in fp32 (the Triton
interpreter gets bf16 arithmetic wrong, and fp32 accumulation is what we want on GPU
anyway). Dots on fp16/bf16 inputs run as tf32: fp16 and bf16 values are exact in tf32,
so only the softmax weights lose bits (to 10 mantissa bits) in ``P @ V``; fp32 inputs
use exact ("ieee") dots. Positions past a sequence's length are masked at load time,
so garbage (even NaN) in unused cache slots or table entries never reaches the output.
Under ``TRITON_INTERPRET=1`` dots are exact fp32 and the final fp32 -> bf16 cast truncates
(the GPU rounds to nearest), so the interpreter checks the logic, not the tf32 rounding.

Grouped-query attention: one program loads a K/V tile once for all query heads of its
KV head; those heads are rows of the dot (padded to 16 rows, the smallest dot tile
older Triton versions accept).

Decode is flash-decoding: the cached length is cut into segments handled by parallel
programs, each writing a partial output and its log-sum-exp; a small kernel merges them.
When the block table is short enough for one segment, the segment kernel writes the
output directly and the merge is skipped.

Sliding windows (Mistral, Gemma 2/3) and soft-capped scores (Gemma 2) are runtime arguments: a
window starts every K/V loop at the window's first token (earlier block-table entries may be
freed, so they are never read), and decode segments wholly before it are skipped, as is their
share of the merge.
"""

import torch
import triton
import triton.language as tl

# Tuning constants (module level so tests can shrink them to exercise every path).
SEGMENT_TOKENS = 256  # decode: cached tokens one program covers (grown for long tables)
MAX_SEGMENTS = 64  # decode: segments per sequence at most (bounds the merge tile)
DECODE_TILE_TOKENS = 64  # decode: tokens per K/V load; SEGMENT_TOKENS is a multiple
PREFILL_ROWS = 64  # prefill: query rows (tokens x group heads) per program
PREFILL_TILE_TOKENS = 32  # prefill: tokens per K/V load
KV_TILE_BYTES = 32 * 1024  # decode: a K tile's bytes at most (fewer tokens a load for wider rows); prefill: half
PREFILL_QUERY_BYTES = 32 * 1024  # prefill: a program's float32 query rows' bytes at most
MIN_DOT_ROWS = 16

# "No window" is a window longer than any context, so the kernels need no branch for it.
NO_WINDOW = 1 << 30
# Compiled Triton reads a module global only when it is a tl.constexpr object (an annotation is
# not enough: "Cannot access global variable" at compile time; the interpreter accepts either).
LOG2_E = tl.constexpr(1.4426950408889634)


def _kv_tile_tokens(tokens: int, cache: torch.Tensor, max_bytes: int) -> int:
    """Tokens per K/V load: ``tokens``, halved while a K tile would pass ``max_bytes`` (256 float32
    dims), so that the K and V tiles pipelined in shared memory fit the 99 KiB a block of sm_86 and
    sm_89 has (tests/test_gpu_compile.py)."""
    row_bytes = triton.next_power_of_2(cache.shape[-1]) * cache.element_size()
    while tokens > MIN_DOT_ROWS and tokens * row_bytes > max_bytes:
        tokens //= 2
    return tokens


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@triton.jit
def _scores(q, k, scale, softcap, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    """Attention scores in log2 units: ``q k^T * scale``, tanh-capped at ``softcap`` when SOFTCAP."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    if SOFTCAP:
        s = softcap * (2 * tl.sigmoid(2 * s / softcap) - 1)  # tanh, from what every Triton version has
    return s * LOG2_E


@triton.jit
def _kv_tile(k_cache_ptr, v_cache_ptr, table, tokens, tok_ok, dims, dim_ok, block_size, kv_head,
             stride_cb, stride_cs, stride_ch):
    """K and V rows of ``tokens`` (one KV head) from the paged cache through the block table, in float32."""
    blocks = tl.load(table + tokens // block_size, mask=tok_ok, other=0).to(tl.int64)
    row_off = blocks * stride_cb + (tokens % block_size) * stride_cs + kv_head * stride_ch
    kv_off = row_off[:, None] + dims[None, :]
    kv_mask = tok_ok[:, None] & dim_ok[None, :]
    k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
    v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
    return k, v


@triton.jit
def _online_softmax_step(m, l, acc, s, v, PRECISION: tl.constexpr):
    """Fold one tile's log2 scores ``s`` and values ``v`` into the running max, sum and output."""
    m_new = tl.maximum(m, tl.max(s, 1))
    # A row may see nothing in this tile yet (its window starts later): keep its sums at zero.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, l, acc


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    block_size, num_kv_heads, head_dim,
    HEADS_P2: tl.constexpr, DIM_P2: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    heads = tl.arange(0, HEADS_P2)[:, None]
    dims = tl.arange(0, DIM_P2)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + heads * stride_ch + dims
    k = tl.load(key_ptr + t * stride_kt + heads * stride_kh + dims, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + t * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping):
    """Write new K/V rows ``[T, Hkv, D]`` into flat slots ``block * block_size + offset``."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_size, num_kv_heads, head_dim,
        HEADS_P2=triton.next_power_of_2(num_kv_heads), DIM_P2=triton.next_power_of_2(head_dim),
    )


# Integer arguments whose value changes from step to step (the table width, the segment count) or
# from layer to layer (the window) are not specialised: Triton would otherwise compile a variant for
# 1 and for multiples of 16, mid-serving. The constexprs left vary over a few buckets
# (DIRECT, SEGMENTS_P2), which triton_warmup.py compiles at model load.
@triton.jit(do_not_specialize=["stride_tb", "num_segments", "window"])
def _decode_segment_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr, lse_ptr,
    scale, window, softcap,
    stride_qb, stride_qh,
    stride_cb, stride_cs, stride_ch,
    stride_tb,
    stride_ob, stride_oh, stride_os,
    block_size, head_dim, num_heads, num_segments, segment_tokens,
    GROUP: tl.constexpr, ROWS: tl.constexpr, DIM_P2: tl.constexpr, TILE: tl.constexpr,
    DIRECT: tl.constexpr, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    seg = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + b)
    seg_start = seg * segment_tokens
    seg_end = tl.minimum(seg_start + segment_tokens, context_len)
    lo = tl.maximum(context_len - window, 0)
    if seg_start >= context_len or seg_end <= lo:  # the merge skips segments wholly out of the window
        return
    seg_start = tl.maximum(seg_start, lo)

    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, DIM_P2)
    row_ok = rows < GROUP
    dim_ok = dims < head_dim
    heads = kv_head * GROUP + rows
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)

    table = block_tables_ptr + b.to(tl.int64) * stride_tb
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DIM_P2], tl.float32)
    for start in range(seg_start, seg_end, TILE):
        tokens = start + tl.arange(0, TILE)
        tok_ok = tokens < seg_end
        k, v = _kv_tile(k_cache_ptr, v_cache_ptr, table, tokens, tok_ok, dims, dim_ok, block_size, kv_head,
                        stride_cb, stride_cs, stride_ch)
        s = _scores(q, k, scale, softcap, PRECISION, SOFTCAP)
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new

    out = acc / l[:, None]
    out_off = b * stride_ob + heads * stride_oh + seg * stride_os
    tl.store(out_ptr + out_off[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])
    if not DIRECT:
        tl.store(lse_ptr + (b * num_heads + heads) * num_segments + seg, m + tl.log2(l), mask=row_ok)


@triton.jit(do_not_specialize=["num_segments", "window"])
def _decode_merge_kernel(
    partial_ptr, lse_ptr, context_lens_ptr, out_ptr,
    stride_pb, stride_ph, stride_ps, stride_ob, stride_oh,
    head_dim, num_heads, num_segments, segment_tokens, window,
    SEGMENTS_P2: tl.constexpr, DIM_P2: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + b)
    used = tl.cdiv(context_len, segment_tokens)
    first = tl.maximum(context_len - window, 0) // segment_tokens
    segs = tl.arange(0, SEGMENTS_P2)
    dims = tl.arange(0, DIM_P2)
    seg_ok = (segs < used) & (segs >= first)
    dim_ok = dims < head_dim
    lse = tl.load(lse_ptr + (b * num_heads + head) * num_segments + segs, mask=seg_ok, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, 0))
    partial = tl.load(partial_ptr + b * stride_pb + head * stride_ph + segs[:, None] * stride_ps + dims[None, :],
                      mask=seg_ok[:, None] & dim_ok[None, :], other=0.0)
    out = tl.sum(weights[:, None] * partial, 0) / tl.sum(weights, 0)
    tl.store(out_ptr + b * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def decode_segments(table_width: int, block_size: int) -> tuple[int, int]:
    """(tokens a segment covers, segments) of a decode over block tables ``table_width`` wide."""
    max_tokens = table_width * block_size
    tile = DECODE_TILE_TOKENS
    segment = max(SEGMENT_TOKENS, triton.cdiv(triton.cdiv(max_tokens, MAX_SEGMENTS), tile) * tile)
    return segment, triton.cdiv(max_tokens, segment)


def decode_bucket(table_width: int, block_size: int) -> tuple[bool, int]:
    """The constexprs a table width selects (DIRECT, SEGMENTS_P2): all that varies with it."""
    num_segments = decode_segments(table_width, block_size)[1]
    return num_segments == 1, triton.next_power_of_2(num_segments)


def decode_bucket_widths(block_size: int) -> list[int]:
    """The narrowest table width of every decode bucket: at most log2(MAX_SEGMENTS) + 1 of them."""
    widths, seen, width = [], set(), 1
    while True:
        bucket = decode_bucket(width, block_size)
        if bucket not in seen:
            seen.add(bucket)
            widths.append(width)
        if decode_segments(width, block_size)[1] >= MAX_SEGMENTS:
            return widths
        width += 1


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, window=0, softcap=0.0):
    """One query token per sequence attends to its whole cached history, or with ``window`` > 0 to
    its last ``window`` tokens (itself included); ``softcap`` > 0 caps the scores (Gemma 2).

    q: ``[B, Hq, D]``; block_tables: ``[B, W]`` int32; context_lens: ``[B]`` int32 (tokens
    cached, the current one included). Returns ``[B, Hq, D]``. The segment count comes from
    the table width ``W``, not from ``context_lens``, so the launch needs no host sync.
    """
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    window = window or NO_WINDOW
    assert SEGMENT_TOKENS % DECODE_TILE_TOKENS == 0
    q = _last_dim_contiguous(q)
    group = num_heads // num_kv_heads
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    tile = _kv_tile_tokens(DECODE_TILE_TOKENS, k_cache, KV_TILE_BYTES)
    segment, num_segments = decode_segments(block_tables.shape[1], block_size)
    direct = num_segments == 1
    if direct:
        partial, lse, partial_strides = out, out, (out.stride(0), out.stride(1), 0)
    else:
        partial = torch.empty((batch, num_heads, num_segments, head_dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((batch, num_heads, num_segments), dtype=torch.float32, device=q.device)
        partial_strides = partial.stride()[:3]
    dim_p2 = triton.next_power_of_2(head_dim)
    _decode_segment_kernel[(batch, num_kv_heads, num_segments)](
        q, k_cache, v_cache, block_tables, context_lens, partial, lse,
        scale, window, softcap,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        *partial_strides,
        block_size, head_dim, num_heads, num_segments, segment,
        GROUP=group, ROWS=max(MIN_DOT_ROWS, triton.next_power_of_2(group)), DIM_P2=dim_p2, TILE=tile,
        DIRECT=direct, PRECISION=_dot_precision(q.dtype), SOFTCAP=softcap > 0,
    )
    if not direct:
        _decode_merge_kernel[(batch, num_heads)](
            partial, lse, context_lens, out,
            partial.stride(0), partial.stride(1), partial.stride(2), out.stride(0), out.stride(1),
            head_dim, num_heads, num_segments, segment, window,
            SEGMENTS_P2=triton.next_power_of_2(num_segments), DIM_P2=dim_p2,
        )
    return out


@triton.jit(do_not_specialize=["stride_tb", "window"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr, out_ptr,
    scale, window, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch,
    stride_tb,
    block_size, head_dim,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, TOKENS: tl.constexpr, DIM_P2: tl.constexpr,
    TILE: tl.constexpr, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):
    q_tile = tl.program_id(0)
    b = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + b)
    q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    first = q_tile * TOKENS
    if first >= q_len:
        return
    context_len = tl.load(context_lens_ptr + b)
    prefix_len = context_len - q_len

    # Row r is query token first + r // GROUP_P2 of head r % GROUP_P2 in this KV head's group.
    rows = tl.arange(0, TOKENS * GROUP_P2)
    q_idx = first + rows // GROUP_P2
    heads = kv_head * GROUP + rows % GROUP_P2
    row_ok = (q_idx < q_len) & (rows % GROUP_P2 < GROUP)
    positions = prefix_len + q_idx
    dims = tl.arange(0, DIM_P2)
    dim_ok = dims < head_dim
    io_mask = row_ok[:, None] & dim_ok[None, :]
    token_rows = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + token_rows[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=io_mask, other=0.0).to(tl.float32)

    table = block_tables_ptr + b.to(tl.int64) * stride_tb
    kv_end = prefix_len + tl.minimum(q_len, first + TOKENS)
    m = tl.full([TOKENS * GROUP_P2], float("-inf"), tl.float32)
    l = tl.zeros([TOKENS * GROUP_P2], tl.float32)
    acc = tl.zeros([TOKENS * GROUP_P2, DIM_P2], tl.float32)
    kv_start = tl.maximum(prefix_len + first - window + 1, 0)
    for start in range(kv_start, kv_end, TILE):
        tokens = start + tl.arange(0, TILE)
        tok_ok = tokens < kv_end
        k, v = _kv_tile(k_cache_ptr, v_cache_ptr, table, tokens, tok_ok, dims, dim_ok, block_size, kv_head,
                        stride_cb, stride_cs, stride_ch)
        s = _scores(q, k, scale, softcap, PRECISION, SOFTCAP)
        visible = (tokens[None, :] <= positions[:, None]) & (tokens[None, :] > positions[:, None] - window)
        visible = visible & tok_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m, l, acc = _online_softmax_step(m, l, acc, s, v, PRECISION)

    out = acc / tl.where(l == 0, 1.0, l)[:, None]  # padding rows past a window may see nothing
    tl.store(out_ptr + token_rows[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


def prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, window=0, softcap=0.0):
    """Ragged chunks of queries attend causally to their cached prefix plus themselves (with
    ``window`` > 0: to the last ``window`` positions up to their own); ``softcap`` as in decode.

    q: ``[T, Hq, D]`` with sequence ``i``'s queries at rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``;
    those are its last ``q_len`` positions of ``context_lens[i]`` (already written to the cache).
    Returns ``[T, Hq, D]``. The grid covers ``T`` query tokens per sequence (programs past a
    sequence's chunk exit at once), which avoids a host sync for the longest chunk.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    window = window or NO_WINDOW
    q = _last_dim_contiguous(q)
    batch = cu_seqlens_q.shape[0] - 1
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or batch == 0:
        return out
    group = num_heads // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    dim_p2 = triton.next_power_of_2(head_dim)
    rows = PREFILL_ROWS
    while rows > MIN_DOT_ROWS and rows * dim_p2 * 4 > PREFILL_QUERY_BYTES:  # 256 dims: 32 rows
        rows //= 2
    tokens_per_program = max(1, rows // group_p2)
    grid = (triton.cdiv(num_tokens, tokens_per_program), batch, num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
        scale, window, softcap,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        block_size, head_dim,
        GROUP=group, GROUP_P2=group_p2, TOKENS=tokens_per_program, DIM_P2=dim_p2,
        TILE=_kv_tile_tokens(PREFILL_TILE_TOKENS, k_cache, KV_TILE_BYTES // 2), PRECISION=_dot_precision(q.dtype),
        SOFTCAP=softcap > 0,
        num_warps=8 if dim_p2 >= 128 else 4,
    )
    return out
