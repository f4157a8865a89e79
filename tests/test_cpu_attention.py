"""The CPU's C++ decode attention (kernels/cpu_attention.cpp) against the float64 reference of
test_kernels and against the torch path: float32 and int8 caches, GQA, odd head dims, and the
same bits for a sequence alone and in any batch. Windows and soft caps: test_kernels_window."""

import pytest
import torch

from gpushare.kernels import paged_attention_torch
from gpushare.kernels.paged_attention_torch import Int8KV
from test_kernels import LAYOUTS, NUM_KV_HEADS, CppDecode, check_decode, paged_cache


def int8_cache(cache):
    scale = cache.abs().amax(dim=-1).nan_to_num(1.0).clamp_min(1e-12) / 127
    return Int8KV(torch.round(cache.nan_to_num(0.0) / scale[..., None]).to(torch.int8), scale)


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size, head_dim", LAYOUTS)
def test_decode_matches_reference(group, block_size, head_dim):
    check_decode(CppDecode, torch.float32, block_size, head_dim, group, seed=block_size * 10 + group)


def test_head_dims_that_are_not_a_multiple_of_the_lanes():
    check_decode(CppDecode, torch.float32, 16, 80, 3, seed=11)
    check_decode(CppDecode, torch.float32, 16, 24, 2, seed=12)


@pytest.mark.parametrize("window, softcap", [(0, 0.0), (21, 0.0), (0, 5.0)])
def test_int8_cache_matches_the_torch_path(window, softcap):
    gen = torch.Generator().manual_seed(3)
    context_lens = torch.tensor([1, 19, 64, 150], dtype=torch.int32)
    k_cache, v_cache, tables = paged_cache(gen, torch.float32, 16, 64, context_lens.tolist())
    k8, v8 = int8_cache(k_cache), int8_cache(v_cache)
    q = torch.randn(len(context_lens), NUM_KV_HEADS * 3, 64, generator=gen)

    out = CppDecode.decode_attention(q, k8, v8, tables, context_lens, 0.125, window, softcap)

    expected = paged_attention_torch.decode_attention(q, k8, v8, tables, context_lens, 0.125, window, softcap)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_a_sequence_gets_the_same_bits_alone_and_in_any_batch():
    gen = torch.Generator().manual_seed(4)
    context_lens = torch.tensor([7, 300, 45, 129, 1, 88], dtype=torch.int32)
    k_cache, v_cache, tables = paged_cache(gen, torch.float32, 16, 64, context_lens.tolist())
    q = torch.randn(len(context_lens), NUM_KV_HEADS * 4, 64, generator=gen)
    batch = CppDecode.decode_attention(q, k_cache, v_cache, tables, context_lens, 0.125)
    for i in range(len(context_lens)):
        alone = CppDecode.decode_attention(q[i:i + 1], k_cache, v_cache, tables[i:i + 1], context_lens[i:i + 1], 0.125)
        assert torch.equal(alone[0], batch[i])
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        other_threads = CppDecode.decode_attention(q, k_cache, v_cache, tables, context_lens, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(other_threads, batch)


def test_a_block_table_too_short_for_its_length_is_refused():
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache, tables = paged_cache(gen, torch.float32, 16, 64, [20])
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        CppDecode.decode_attention(torch.randn(1, NUM_KV_HEADS, 64), k_cache, v_cache, tables[:, :1],
                                   torch.tensor([40], dtype=torch.int32), 0.125)
