"""Device kernels behind one dispatch point: paged attention, weight-only quantized matmul and batched LoRA.

Triton kernels run when the tensors live on CUDA (or when ``GPUSHARE_KERNELS=triton``
forces them, e.g. under ``TRITON_INTERPRET=1`` in tests); on the CPU attention runs the C++ kernel
(cpu_ops.py) where it builds, a prompt's rows one by one as decode rows, as do RMSNorm and RoPE with
the cache write on float32 rows and LoRA on float32 or bfloat16 rows, and the torch path runs otherwise
(or with ``GPUSHARE_KERNELS=torch``).
Nothing above this package knows which one ran.
"""

import importlib
import os

import torch
import torch.nn.functional as F

from gpushare.kernels import cpu_ops as _cpu_ops
from gpushare.kernels import lora_torch as _lora_torch
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


def cpu_kernels_run() -> bool:
    """Whether the CPU's C++ kernels (cpu_ops.py) run: built, and no GPUSHARE_KERNELS picking a path
    (read at each call, as ``_use_triton`` does)."""
    return not os.environ.get("GPUSHARE_KERNELS") and _cpu_ops.loaded()


def _cpp_float32(x) -> bool:
    """Whether the C++ kernels take float32 ``x``: on the CPU, where they run."""
    return not x.is_cuda and x.dtype == torch.float32 and cpu_kernels_run()


def _cache_parts(cache) -> tuple:
    """A layer's K (or V) cache as the C++ kernels take it: (values, their int8 scales or None)."""
    if isinstance(cache, _attention_torch.Int8KV):
        return cache.data, cache.scale
    return cache, None


def _cpp_cache(x, cache) -> bool:
    """Whether the C++ kernels take float32 ``x`` with a float32, bfloat16 or int8 ``cache``."""
    return _cache_parts(cache)[0].dtype in (torch.float32, torch.bfloat16, torch.int8) and _cpp_float32(x)


def rms_norm(x, weight, eps: float, residual=None):
    """``(RMSNorm(x + residual), x + residual)`` (without ``residual``: of ``x``, and ``x``): one C++ call
    for float32 rows on the CPU, torch's otherwise."""
    if x.dim() == 2 and _cpp_float32(x) and weight.dtype == torch.float32:
        return tuple(torch.ops.gpushare.rms_norm(x, residual, weight, eps))
    total = x if residual is None else x + residual
    return F.rms_norm(total, (total.shape[-1],), weight, eps), total


def try_rope_and_cache(qkv, cos, sin, q_heads: int, kv_heads: int, k_cache, v_cache, slot_mapping) -> bool:
    """RoPE on the q and k heads of a fused projection's output ``qkv [T, (Hq + 2 Hkv) * D]`` in place, and
    k and v into their cache slots, in one C++ call (bit for bit the torch path's numbers); False, with
    nothing done, where that kernel cannot run (not float32 on the CPU, another cache dtype)."""
    if not (qkv.is_contiguous() and cos.dtype == torch.float32 and _cpp_cache(qkv, k_cache)):
        return False
    (k_values, k_scale), (v_values, v_scale) = _cache_parts(k_cache), _cache_parts(v_cache)
    torch.ops.gpushare.rope_and_cache(qkv, cos, sin, q_heads, kv_heads, k_values, v_values, k_scale, v_scale,
                                      slot_mapping)
    return True


def decode_layers(x, weights, kv_caches, cos, sin, slot_mapping, block_tables, context_lens, first_layer: int,
                  lora_a=(), lora_b=(), lora_slots=None, lora_scales=None, pause=None, head_rows=None):
    """Decode rows ``x`` through layers ``first_layer`` to ``first_layer + len(kv_caches)`` in one C++ call
    (cpu_decode.cpp), given the model's ``weights`` (gpushare.models.fused_decode.DecodeWeights) and
    those layers' ``kv_caches``; None, with nothing done, where the C++ kernels cannot take them. With
    adapters, ``lora_a``/``lora_b`` hold every layer's stacks (lora_torch.py's layout), seven a layer
    (q, k, v, o, gate, up, down), ``lora_slots`` each row's slot and ``lora_scales`` each slot's scale.
    ``pause`` (a uint8 [1] flag, models/pause_signal.py): the call stops after the first layer that ends
    with it set. ``head_rows`` (int64, in a call that ends with the model's last layer): also the final
    norm and the LM head of those rows (``weights.head``). Returns (x after the layers run, how many ran,
    the head's logits, empty unless the last layer ran and ``head_rows`` was given)."""
    if not (kv_caches and cos.dtype == torch.float32 and _cpp_cache(x, kv_caches[0][0])):
        return None
    k_parts = [_cache_parts(k) for k, _ in kv_caches]
    v_parts = [_cache_parts(v) for _, v in kv_caches]
    end = first_layer + len(kv_caches)
    n, w = slice(2 * first_layer, 2 * end), slice(4 * first_layer, 4 * end)
    return torch.ops.gpushare.decode_layers(
        x, weights.norms[n], weights.codes[w], weights.scales[w], weights.mins[w], weights.out_features[w],
        [p[0] for p in k_parts], [p[0] for p in v_parts], [p[1] for p in k_parts], [p[1] for p in v_parts],
        cos, sin, slot_mapping, block_tables, context_lens, weights.q_heads, weights.kv_heads, weights.eps,
        weights.attn_scale, weights.windows[first_layer:end], weights.softcap, lora_a[7 * first_layer:7 * end],
        lora_b[7 * first_layer:7 * end], lora_slots, lora_scales, pause,
        *(weights.head if head_rows is not None else (None, None, None, None, 0)), head_rows)


def prepare_cpu() -> None:
    """Build (once per machine) and load the CPU's C++ kernels now rather than at first use."""
    _cpu_ops.loaded()


def attention_by_row(q, k_cache, v_cache, block_tables, context_lens, scale, window=0, softcap=0.0):
    """Every row of ``q [R, Hq, D]`` attends to its own sequence's first ``context_lens[r]`` cached tokens
    (``block_tables [R, W]``: row r's sequence's table) in one C++ call (cpu_attention.cpp): a prompt's
    rows computed as the decode rows they would be, so a token's numbers never depend on whether it was
    prefilled or decoded, or with what. None, with nothing done, where the C++ kernels cannot take it."""
    if not _cpp_cache(q, k_cache):
        return None
    (k_values, k_scale), (v_values, v_scale) = _cache_parts(k_cache), _cache_parts(v_cache)
    return torch.ops.gpushare.decode_attention(q, k_values, v_values, k_scale, v_scale, block_tables, context_lens,
                                               scale, window or 0, softcap or 0.0)


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, window=0, softcap=0.0):
    """``window`` > 0: a sliding window of that many tokens; ``softcap`` > 0: tanh-capped scores."""
    out = attention_by_row(q, k_cache, v_cache, block_tables, context_lens, scale, window, softcap)
    if out is not None:
        return out
    return _ops(q, _attention_torch).decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                                      window, softcap)


def prefill_rows(block_tables, cu_seqlens_q, context_lens) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged prompt chunks' rows as the decode rows they would be: each row's sequence's block table
    ``[T, W]`` and its context length ``[T]`` int32 (its position + 1), for attention_by_row."""
    cu = cu_seqlens_q.long()
    seq = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=cu.device), cu[1:] - cu[:-1])
    # row j of chunk i sits at position context_len - (cu[i + 1] - j)
    lengths = context_lens.long()[seq] - cu[1:][seq] + torch.arange(seq.numel(), device=cu.device) + 1
    return block_tables.index_select(0, seq), lengths.int()


def prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, window=0, softcap=0.0):
    """Ragged prompt chunks (paged_attention_torch.prefill_attention's arguments); on the CPU's C++ path
    each row as the decode row it would be (attention_by_row)."""
    if _cpp_cache(q, k_cache):
        return attention_by_row(q, k_cache, v_cache, *prefill_rows(block_tables, cu_seqlens_q, context_lens), scale,
                                window, softcap)
    return _ops(q, _attention_torch).prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                                       context_lens, scale, window, softcap)


def int8_weight_matmul(x, qweight, scales):
    """``x [..., K] @ w.T`` for an int8 weight ``[N, K]`` with per-row ``scales [N]``."""
    return _ops(x, _quant_torch).int8_weight_matmul(x, qweight, scales)


def int4_weight_matmul(x, qweight, scales, mins, group_size):
    """``x [..., K] @ w.T`` for a packed int4 weight ``[N, K // 2]`` with per-group ``scales``/``mins``."""
    return _ops(x, _quant_torch).int4_weight_matmul(x, qweight, scales, mins, group_size)


def lora_apply(y, x, a_stack, b_stack, slot_of_row, scale_of_slot):
    """Add each row's own adapter product to ``y [rows, out]`` in place (kernels/lora_torch.py has the
    layout); ``y`` may be a column slice of a fused projection's output, which the Triton and C++
    kernels take as it is (the torch path through a copy). A rank-0 stack (no loaded adapter has this
    target) adds nothing."""
    if a_stack.shape[1] == 0:
        return y
    if _use_triton(y):
        return _ops(y, _lora_torch).lora_apply(y, x, a_stack, b_stack, slot_of_row, scale_of_slot)
    if _cpp_lora(y, x):
        torch.ops.gpushare.lora_apply(y, x, a_stack, b_stack, slot_of_row, scale_of_slot)
        return y
    if y.is_contiguous():
        return _lora_torch.lora_apply(y, x, a_stack, b_stack, slot_of_row, scale_of_slot)
    y.copy_(_lora_torch.lora_apply(y.contiguous(), x, a_stack, b_stack, slot_of_row, scale_of_slot))
    return y


def _cpp_lora(y, x) -> bool:
    """Whether the C++ LoRA kernel (cpu_lora.cpp) takes float32 or bfloat16 ``y`` and ``x`` on the CPU."""
    dtypes = (torch.float32, torch.bfloat16)
    return (not y.is_cuda and y.dtype in dtypes and x.dtype in dtypes and y.dim() == 2 and y.stride(1) == 1
            and cpu_kernels_run())
