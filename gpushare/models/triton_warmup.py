"""Compile every Triton kernel variant a model can launch when it is made ready on a GPU, not mid-serving.

A Triton kernel compiles (1-2 s on the engine thread) the first time it meets a new specialisation.
The kernels do not specialise the integers that change from step to step (table width, segment
count, batch rows, window, LoRA rank: ``do_not_specialize`` in ``kernels/*_triton.py``), so what
still picks a compiled variant is a few buckets: a decode's (DIRECT, SEGMENTS_P2) from its table
width (``paged_attention_triton.decode_bucket``, at most seven) and a matmul's tile config from its
batch rows (``quant_matmul_triton.tile_buckets``, four). ``warm_up`` runs each bucket once through
the same dispatch functions the model calls, on scratch tensors shaped and strided as the model's
own, so each variant compiles here. LoRA is not warmed: its adapters (and their ranks) come later.
"""

import torch

from gpushare.kernels import paged_attention_triton as attention
from gpushare.kernels import quant_matmul_triton as quant
from gpushare.models.linear import Linear


def _scratch_cache(cache: torch.Tensor) -> torch.Tensor:
    """A one-block cache with ``cache``'s strides and dtype (a warm-up never writes a real block)."""
    return torch.zeros_like(torch.empty_strided((1, *cache.shape[1:]), cache.stride(), dtype=cache.dtype,
                                                device=cache.device))


def attention_buckets(q_heads: int, dtype: torch.dtype, k_cache, v_cache, scale: float, window: int,
                      softcap: float) -> None:
    """The cache write, the prefill and every decode bucket of one layer's attention, as the model calls them."""
    k_cache, v_cache = _scratch_cache(k_cache), _scratch_cache(v_cache)
    _, block_size, kv_heads, head_dim = k_cache.shape
    device = k_cache.device
    rows = 2
    qkv = torch.zeros(rows, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
    _, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = torch.zeros(rows, q_heads, head_dim, dtype=dtype, device=device)  # RoPE's output is contiguous
    slots = torch.arange(rows, dtype=torch.long, device=device)
    attention.reshape_and_cache(k.contiguous().view(rows, kv_heads, head_dim), v.view(rows, kv_heads, head_dim),
                                k_cache, v_cache, slots)
    one_block = torch.zeros(1, 1, dtype=torch.int32, device=device)
    attention.prefill_attention(q, k_cache, v_cache, one_block, torch.tensor([0, rows], dtype=torch.int32, device=device),
                                torch.tensor([rows], dtype=torch.int32, device=device), scale, window, softcap)
    lens = torch.ones(1, dtype=torch.int32, device=device)
    for width in attention.decode_bucket_widths(block_size):
        table = torch.zeros(1, width, dtype=torch.int32, device=device)
        attention.decode_attention(q[:1], k_cache, v_cache, table, lens, scale, window, softcap)


def matmul_buckets(linear, dtype: torch.dtype) -> None:
    """Every tile-config bucket of one int8 or int4 linear (models/linear.Linear) on ``dtype`` activations."""
    in_features = linear.qweight.shape[1] * (2 if linear.format == "int4" else 1)
    for m in quant.tile_buckets():
        x = torch.zeros(m, in_features, dtype=dtype, device=linear.qweight.device)
        if linear.format == "int8":
            quant.int8_weight_matmul(x, linear.qweight, linear.scales)
        else:
            quant.int4_weight_matmul(x, linear.qweight, linear.scales, linear.mins, linear.group_size)


def warm_up(model, kv_caches: list, dtype: torch.dtype) -> None:
    """Compile every kernel variant ``model`` (models/llama.LlamaModel) can launch over ``kv_caches``
    (its per-layer (K, V) views) with ``dtype`` activations; nothing off CUDA."""
    if kv_caches and kv_caches[0][0].is_cuda:
        model_buckets(model, kv_caches, dtype)
        torch.cuda.synchronize()


def model_buckets(model, kv_caches: list, dtype: torch.dtype) -> None:
    """Every bucket of every distinct attention layer and Triton-run linear of ``model``, once each."""
    done = set()
    for layer, (k_cache, v_cache) in zip(model.layers, kv_caches):
        attn = layer.self_attn
        key = (attn.num_heads, k_cache.shape[1:], k_cache.dtype, k_cache.stride(), attn.softcap > 0)
        if key not in done:
            done.add(key)
            attention_buckets(attn.num_heads, dtype, k_cache, v_cache, attn.scale, attn.window, attn.softcap)
    for module in model.modules():
        if isinstance(module, Linear) and module.format in ("int8", "int4") and not module.blocks:
            key = (module.format, module.qweight.shape, module.qweight.stride(), module.group_size)
            if key not in done:
                done.add(key)
                matmul_buckets(module, dtype)
