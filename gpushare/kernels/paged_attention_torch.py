"""Paged attention in plain torch: the CPU path and the reference for the Triton kernels.

Cache layout (shared with the Triton kernels): ``k_cache`` and ``v_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous within a block; blocks may lie
further apart (the device pool stores every layer of a block together). A sequence's token ``t``
lives in block ``block_table[t // block_size]`` at offset ``t % block_size``. The cache may be
stored in a narrower dtype than the queries; keys and values are widened as they are gathered.
An ``Int8KV`` cache (CPU only) keeps int8 values with one float32 scale per token and KV head.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Int8KV:
    """One layer's K (or V) cache in int8: ``data [num_blocks, block_size, Hkv, D]`` and, per token
    and head, ``scale [num_blocks, block_size, Hkv]`` (symmetric: value = data * scale)."""
    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


def _store(cache, where, rows) -> None:
    if isinstance(cache, Int8KV):
        scale = rows.float().abs().amax(dim=-1).clamp_min(1e-12) / 127
        cache.data.index_put_(where, torch.round(rows.float() / scale[..., None]).to(torch.int8))
        cache.scale.index_put_(where, scale)
    else:
        cache.index_put_(where, rows.to(cache.dtype))


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping):
    """Write new K/V rows ``[T, Hkv, D]`` into flat slots ``block * block_size + offset``."""
    block_size = k_cache.shape[1]
    where = (slot_mapping // block_size, slot_mapping % block_size)
    _store(k_cache, where, key)
    _store(v_cache, where, value)


def _gather(cache, block_tables, length, dtype, start=0):
    """Rows ``[start, length)`` of each table's sequence: ``[B, length - start, Hkv, D]``, one copy.

    Only the blocks holding those rows are read: with a sliding window the table's earlier
    entries may already be freed. ``index_select`` on whole blocks moves each block as one
    memcpy; fancy indexing is ~4x slower.
    """
    num_blocks, block_size = cache.shape[:2]
    batch = block_tables.shape[0]
    first, used = start // block_size, (length + block_size - 1) // block_size
    ids = block_tables[:, first:used].reshape(-1).long()
    shape = (batch, (used - first) * block_size, *cache.shape[2:])
    if isinstance(cache, Int8KV):
        rows = cache.data.view(num_blocks, -1).index_select(0, ids).to(dtype).view(shape)
        rows *= cache.scale.view(num_blocks, -1).index_select(0, ids).to(dtype).view(*shape[:3], 1)
    else:
        rows = cache.view(num_blocks, -1).index_select(0, ids).to(dtype).view(shape)
    offset = first * block_size
    return rows[:, start - offset:length - offset]


def _attend(q, keys, values, scale, softcap, mask=None, causal=False):
    """Attention of ``q [1, Hq, Tq, D]`` over ``keys``/``values [1, Hkv, Tk, D]``; soft-capped scores
    (Gemma 2) need the scores themselves, so they take the explicit float32 path."""
    if not softcap:
        # 4-D with a batch of one: SDPA's CPU kernel takes 3-D inputs through a path 3x slower
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=q.shape[1] != keys.shape[1])
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1).float(), values.repeat_interleave(group, dim=1).float()
    scores = q.float() @ keys.transpose(-1, -2) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ values).to(q.dtype)


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, window=0, softcap=0.0):
    """One query token per sequence attends to its whole cached history, or with ``window`` > 0 to
    its last ``window`` tokens (itself included); ``softcap`` > 0 caps the scores (Gemma 2).

    q: ``[B, Hq, D]``; block_tables: ``[B, W]`` int32; context_lens: ``[B]`` int32 (tokens
    cached, the current one included). Returns ``[B, Hq, D]``.

    Each sequence is computed on its own, over exactly its own length: a sequence's result is
    then bit for bit the same alone and in any batch (a batched, padded and masked SDPA rounds
    differently with the batch, by ~1e-7, which bfloat16 activations of quantized weights turn
    into other tokens). Measured on CPU it is also faster from batch 16 on than the padded batch
    (2.6 vs 3.8 ms a layer at 16, 10 vs 17.5 at 64; docs/benchmarks.md).
    """
    lengths = context_lens.tolist()
    out = torch.empty_like(q)
    for i, length in enumerate(lengths):
        start = max(0, length - window) if window else 0
        keys = _gather(k_cache, block_tables[i:i + 1], length, q.dtype, start).transpose(1, 2)  # [1, Hkv, n, D]
        values = _gather(v_cache, block_tables[i:i + 1], length, q.dtype, start).transpose(1, 2)
        out[i] = _attend(q[i][None, :, None], keys, values, scale, softcap)[0, :, 0]
    return out


def prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, window=0, softcap=0.0):
    """Ragged chunks of queries attend causally to their cached prefix plus themselves (with
    ``window`` > 0: to the last ``window`` positions up to their own); ``softcap`` as in decode.

    q: ``[T, Hq, D]`` with sequence ``i``'s queries at rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``;
    those are its last ``q_len`` positions of ``context_lens[i]`` (already written to the cache).
    Returns ``[T, Hq, D]``.
    """
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    lengths = context_lens.tolist()
    for i, length in enumerate(lengths):
        qs = q[starts[i]:starts[i + 1]]
        q_len = qs.shape[0]
        first = max(0, length - q_len - window + 1) if window else 0  # the earliest key any query sees
        keys = _gather(k_cache, block_tables[i:i + 1], length, q.dtype, first)[0]
        values = _gather(v_cache, block_tables[i:i + 1], length, q.dtype, first)[0]
        mask = None
        if q_len != length or window:
            # Query j sits at position length - q_len + j and may see keys up to it (and, with a
            # window, after its position - window).
            rows = torch.arange(q_len, device=q.device)[:, None] + (length - q_len)
            cols = torch.arange(first, length, device=q.device)[None, :]
            mask = cols <= rows
            if window:
                mask &= cols > rows - window
        attn = _attend(qs.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                       values.transpose(0, 1)[None], scale, softcap, mask, causal=mask is None)
        out[starts[i]:starts[i + 1]] = attn[0].transpose(0, 1)
    return out
