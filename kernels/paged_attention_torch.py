"""Paged attention in plain torch: the CPU path and the reference for the Triton kernels.

Cache layout (shared with the Triton kernels): ``k_cache`` and ``v_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``. A sequence's token ``t`` lives in
block ``block_table[t // block_size]`` at offset ``t % block_size``.
"""

import torch
import torch.nn.functional as F


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping):
    """Write new K/V rows ``[T, Hkv, D]`` into flat slots ``block * block_size + offset``."""
    num_blocks, block_size = k_cache.shape[:2]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _gather(cache, block_tables, length):
    """Rows ``[0, length)`` of each table's sequence: ``[B, length, Hkv, D]``, one contiguous copy.

    ``index_select`` on whole blocks moves each block as one memcpy; fancy indexing is ~4x slower.
    """
    num_blocks, block_size = cache.shape[:2]
    batch = block_tables.shape[0]
    used = (length + block_size - 1) // block_size
    ids = block_tables[:, :used].reshape(-1).long()
    rows = cache.view(num_blocks, -1).index_select(0, ids)
    return rows.view(batch, used * block_size, *cache.shape[2:])[:, :length]


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale):
    """One query token per sequence attends to its whole cached history.

    q: ``[B, Hq, D]``; block_tables: ``[B, W]`` int32; context_lens: ``[B]`` int32 (tokens
    cached, the current one included). Returns ``[B, Hq, D]``.
    """
    batch, num_heads, head_dim = q.shape
    lengths = context_lens.long()
    max_len, min_len = int(lengths.max()), int(lengths.min())
    # One gather for the whole batch keeps the per-step Python work independent of B.
    keys = _gather(k_cache, block_tables, max_len)
    values = _gather(v_cache, block_tables, max_len)
    pad = torch.arange(max_len, device=q.device)[None, :] >= lengths[:, None]
    if min_len < max_len:
        # Rows past a sequence's end hold stale values, even NaN, which a mask cannot cancel
        # (NaN - inf and 0 x NaN are NaN): zero them in our private copies.
        tail = pad[:, min_len:, None, None]
        keys[:, min_len:].masked_fill_(tail, 0)
        values[:, min_len:].masked_fill_(tail, 0)
    out = F.scaled_dot_product_attention(
        q.view(batch, num_heads, 1, head_dim).to(keys.dtype),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=~pad[:, None, None, :],
        scale=scale,
        enable_gqa=num_heads != k_cache.shape[2],
    )
    return out.view(batch, num_heads, head_dim).to(q.dtype)


def prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale):
    """Ragged chunks of queries attend causally to their cached prefix plus themselves.

    q: ``[T, Hq, D]`` with sequence ``i``'s queries at rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``;
    those are its last ``q_len`` positions of ``context_lens[i]`` (already written to the cache).
    Returns ``[T, Hq, D]``.
    """
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    lengths = context_lens.tolist()
    for i, length in enumerate(lengths):
        qs = q[starts[i]:starts[i + 1]]
        q_len = qs.shape[0]
        keys = _gather(k_cache, block_tables[i:i + 1], length)[0]
        values = _gather(v_cache, block_tables[i:i + 1], length)[0]
        mask = None
        if q_len != length:
            # Query j sits at position length - q_len + j and may see keys up to it.
            rows = torch.arange(q_len, device=q.device)[:, None] + (length - q_len)
            mask = torch.arange(length, device=q.device)[None, :] <= rows
        attn = F.scaled_dot_product_attention(
            qs.transpose(0, 1).to(keys.dtype),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        out[starts[i]:starts[i + 1]] = attn.transpose(0, 1).to(q.dtype)
    return out
