"""Paged attention in plain torch: the CPU path and the reference for the Triton kernels.

Cache layout (shared with the Triton kernels): ``k_cache`` and ``v_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous within a block; blocks may lie
further apart (the device pool stores every layer of a block together). A sequence's token ``t``
lives in block ``block_table[t // block_size]`` at offset ``t % block_size``. The cache may be
stored in a narrower dtype than the queries; keys and values are widened as they are gathered.
"""

import torch
import torch.nn.functional as F


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping):
    """Write new K/V rows ``[T, Hkv, D]`` into flat slots ``block * block_size + offset``."""
    block_size = k_cache.shape[1]
    where = (slot_mapping // block_size, slot_mapping % block_size)
    k_cache.index_put_(where, key.to(k_cache.dtype))
    v_cache.index_put_(where, value.to(v_cache.dtype))


def _gather(cache, block_tables, length, dtype):
    """Rows ``[0, length)`` of each table's sequence: ``[B, length, Hkv, D]`` in ``dtype``, one
    contiguous copy.

    ``index_select`` on whole blocks moves each block as one memcpy; fancy indexing is ~4x slower.
    """
    num_blocks, block_size = cache.shape[:2]
    batch = block_tables.shape[0]
    used = (length + block_size - 1) // block_size
    ids = block_tables[:, :used].reshape(-1).long()
    rows = cache.view(num_blocks, -1).index_select(0, ids).to(dtype)
    return rows.view(batch, used * block_size, *cache.shape[2:])[:, :length]


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale):
    """One query token per sequence attends to its whole cached history.

    q: ``[B, Hq, D]``; block_tables: ``[B, W]`` int32; context_lens: ``[B]`` int32 (tokens
    cached, the current one included). Returns ``[B, Hq, D]``.

    Each sequence is computed on its own, over exactly its own length: a sequence's result is
    then bit for bit the same alone and in any batch (a batched, padded and masked SDPA rounds
    differently with the batch, by ~1e-7, which bfloat16 activations of quantized weights turn
    into other tokens). Measured on CPU it is also faster from batch 16 on than the padded batch
    (2.6 vs 3.8 ms a layer at 16, 10 vs 17.5 at 64; docs/benchmarks.md).
    """
    lengths = context_lens.tolist()
    if len(lengths) == 1:
        return _attend_one(q[0], k_cache, v_cache, block_tables[:1], lengths[0], scale)[None]
    out = torch.empty_like(q)
    for i, length in enumerate(lengths):
        out[i] = _attend_one(q[i], k_cache, v_cache, block_tables[i:i + 1], length, scale)
    return out


def _attend_one(q, k_cache, v_cache, block_table, length, scale):
    """q ``[Hq, D]`` of one sequence over its ``length`` cached keys and values."""
    keys = _gather(k_cache, block_table, length, q.dtype).transpose(1, 2)  # [1, Hkv, length, D]
    values = _gather(v_cache, block_table, length, q.dtype).transpose(1, 2)
    # 4-D with a batch of one: SDPA's CPU kernel takes 3-D inputs through a path 3x slower
    out = F.scaled_dot_product_attention(q[None, :, None], keys, values, scale=scale,
                                         enable_gqa=q.shape[0] != k_cache.shape[2])
    return out[0, :, 0]


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
        keys = _gather(k_cache, block_tables[i:i + 1], length, q.dtype)[0]
        values = _gather(v_cache, block_tables[i:i + 1], length, q.dtype)[0]
        mask = None
        if q_len != length:
            # Query j sits at position length - q_len + j and may see keys up to it.
            rows = torch.arange(q_len, device=q.device)[:, None] + (length - q_len)
            mask = torch.arange(length, device=q.device)[None, :] <= rows
        attn = F.scaled_dot_product_attention(  # 4-D, a batch of one: the fast CPU path (see _attend_one)
            qs.transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        out[starts[i]:starts[i + 1]] = attn[0].transpose(0, 1)
    return out
