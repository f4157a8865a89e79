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


def _gather(cache, block_table, length):
    """One sequence's first ``length`` cached rows, ``[length, Hkv, D]``."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:length]


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale):
    """One query token per sequence attends to its whole cached history.

    q: ``[B, Hq, D]``; block_tables: ``[B, W]`` int32; context_lens: ``[B]`` int32 (tokens
    cached, the current one included). Returns ``[B, Hq, D]``.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    max_len = int(context_lens.max())
    max_blocks = (max_len + block_size - 1) // block_size
    # One gather for the whole batch keeps the per-step Python work independent of B.
    tables = block_tables[:, :max_blocks].long()
    keys = k_cache[tables].flatten(1, 2)[:, :max_len]  # [B, L, Hkv, D]
    values = v_cache[tables].flatten(1, 2)[:, :max_len]
    qg = q.view(batch, num_kv_heads, group, head_dim).float()
    scores = torch.einsum("bhgd,blhd->bhgl", qg, keys.float()) * scale
    positions = torch.arange(max_len, device=q.device)
    pad = positions[None, :] >= context_lens[:, None].long()
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    # Rows past a sequence's end may hold another request's stale values, even NaN or inf.
    values = values.masked_fill(pad[:, :, None, None], 0)
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgl,blhd->bhgd", probs, values.float())
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


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
        keys = _gather(k_cache, block_tables[i], length)
        values = _gather(v_cache, block_tables[i], length)
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
