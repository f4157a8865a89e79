"""Attention kernels over the paged KV cache, behind one dispatch point.

Triton kernels run when the tensors live on CUDA (or when ``GPUSHARE_KERNELS=triton``
forces them, e.g. under ``TRITON_INTERPRET=1`` in tests); the torch path runs otherwise.
Nothing above this package knows which one ran.
"""

import os

from gpushare.kernels import paged_attention_torch as _torch_ops


def _use_triton(tensor) -> bool:
    forced = os.environ.get("GPUSHARE_KERNELS", "")
    if forced:
        return forced == "triton"
    return tensor.is_cuda


def _ops(tensor):
    if _use_triton(tensor):
        from gpushare.kernels import paged_attention_triton

        return paged_attention_triton
    return _torch_ops


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping):
    return _ops(key).reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale):
    return _ops(q).decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)


def prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale):
    return _ops(q).prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale)
