"""Device kernels behind one dispatch point: paged attention and weight-only quantized matmul.

Triton kernels run when the tensors live on CUDA (or when ``GPUSHARE_KERNELS=triton``
forces them, e.g. under ``TRITON_INTERPRET=1`` in tests); the torch path runs otherwise.
Nothing above this package knows which one ran.
"""

import importlib
import os

from gpushare.kernels import paged_attention_torch as _attention_torch
from gpushare.kernels import quant_matmul_torch as _quant_torch


def _use_triton(tensor) -> bool:
    forced = os.environ.get("GPUSHARE_KERNELS", "")
    if forced:
        return forced == "triton"
    return tensor.is_cuda


def _ops(tensor, torch_ops):
    """``torch_ops`` or its Triton twin (``*_torch`` -> ``*_triton``, imported on first use)."""
    if _use_triton(tensor):
        return importlib.import_module(torch_ops.__name__.removesuffix("_torch") + "_triton")
    return torch_ops


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping):
    return _ops(key, _attention_torch).reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, window=0, softcap=0.0):
    """``window`` > 0: a sliding window of that many tokens; ``softcap`` > 0: tanh-capped scores."""
    return _ops(q, _attention_torch).decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                                      window, softcap)


def prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, window=0, softcap=0.0):
    return _ops(q, _attention_torch).prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                                       context_lens, scale, window, softcap)


def int8_weight_matmul(x, qweight, scales):
    """``x [..., K] @ w.T`` for an int8 weight ``[N, K]`` with per-row ``scales [N]``."""
    return _ops(x, _quant_torch).int8_weight_matmul(x, qweight, scales)


def int4_weight_matmul(x, qweight, scales, mins, group_size):
    """``x [..., K] @ w.T`` for a packed int4 weight ``[N, K // 2]`` with per-group ``scales``/``mins``."""
    return _ops(x, _quant_torch).int4_weight_matmul(x, qweight, scales, mins, group_size)
