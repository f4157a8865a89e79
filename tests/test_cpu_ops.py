"""The CPU's C++ kernels (kernels/cpu_attention.cpp, cpu_ops.cpp): attention against the float64 reference
of test_kernels and against the torch path: float32, bfloat16 and int8 caches, GQA, odd head dims; the
same bits for a sequence alone and in any batch, and for a prompt's rows prefilled, decoded one by one,
or after a cached prefix (windows and soft caps: test_kernels_window); RMSNorm with its residual add;
RoPE with the cache write, bit for bit the torch path."""

import pytest
import torch

from gpushare.kernels import paged_attention_torch
from gpushare.kernels.paged_attention_torch import Int8KV
from test_kernels import LAYOUTS, NUM_KV_HEADS, CppAttention, cached_rows, check_decode, check_prefill, paged_cache


# The pair reference's float64 scores differ from the kernels' float32 ones in their last bits, so a
# probability at a bfloat16 rounding boundary may round the other way there: one step of 2^-8 of it.
PAIR_ATOL = 2e-4


def pair_reference(q, k_cache, v_cache, tables, lengths, scale, window=0, softcap=0.0):
    """Attention over bfloat16 caches in the kernels' pair arithmetic, in float64 but for its roundings:
    each query row rounded to bfloat16, and each row's probabilities e^(s - max s) (float32) too. Row r of
    q attends to its table's first lengths[r] keys."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for r, length in enumerate(lengths.tolist()):
        first = max(0, length - window) if window else 0
        keys = cached_rows(k_cache, tables[r], length)[first:].repeat_interleave(group, dim=1)
        values = cached_rows(v_cache, tables[r], length)[first:].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[r].to(torch.bfloat16).double(), keys) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        p = torch.exp((scores - scores.amax(dim=-1, keepdim=True)).float()).to(torch.bfloat16).double()
        out[r] = (torch.einsum("hl,lhd->hd", p, values) / p.sum(dim=-1, keepdim=True)).float()
    return out


def prompt_rows(tables, cu_seqlens, context_lens):
    """Each prompt row's block table and length (its position + 1), as the decode row it would be."""
    row_tables, lengths = [], []
    for s in range(len(context_lens)):
        rows = int(cu_seqlens[s + 1] - cu_seqlens[s])
        for i in range(rows):
            row_tables.append(tables[s])
            lengths.append(int(context_lens[s]) - rows + 1 + i)
    return torch.stack(row_tables), torch.tensor(lengths, dtype=torch.int32)


def int8_cache(cache):
    scale = cache.abs().amax(dim=-1).nan_to_num(1.0).clamp_min(1e-12) / 127
    return Int8KV(torch.round(cache.nan_to_num(0.0) / scale[..., None]).to(torch.int8), scale)


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size, head_dim", LAYOUTS)
def test_decode_matches_reference(group, block_size, head_dim):
    check_decode(CppAttention, torch.float32, block_size, head_dim, group, seed=block_size * 10 + group)


@pytest.mark.usefixtures("nan_allocations")
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size, head_dim", LAYOUTS)
def test_prefill_matches_reference(group, block_size, head_dim):
    check_prefill(CppAttention, torch.float32, block_size, head_dim, group, seed=block_size * 10 + group)


@pytest.mark.parametrize("cache", ["bfloat16", "int8"])
def test_prefill_over_narrow_caches_matches_the_torch_path(cache):
    gen = torch.Generator().manual_seed(6)
    q_lens, context_lens = [37, 9], [37, 70]
    k_cache, v_cache, tables = paged_cache(gen, torch.float32, 16, 64, context_lens)
    if cache == "int8":
        k_cache, v_cache = int8_cache(k_cache), int8_cache(v_cache)
    else:
        k_cache, v_cache = k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16)
    q = torch.randn(sum(q_lens), NUM_KV_HEADS * 3, 64, generator=gen)
    cu = torch.tensor([0, 37, 46], dtype=torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)

    out = CppAttention.prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.125)

    if cache == "int8":
        expected = paged_attention_torch.prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.125)
    else:  # bfloat16: the pair arithmetic (kernels/cpu_attention.cpp)
        expected = pair_reference(q, k_cache, v_cache, *prompt_rows(tables, cu, lens), 0.125)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6 if cache == "int8" else PAIR_ATOL)


@pytest.mark.parametrize("window", [0, 21])
def test_a_prompt_row_gets_the_same_bits_prefilled_decoded_or_after_a_cached_prefix(window):
    gen = torch.Generator().manual_seed(7)
    length = 150
    k_cache, v_cache, tables = paged_cache(gen, torch.bfloat16, 16, 64, [length])
    q = torch.randn(length, NUM_KV_HEADS * 3, 64, generator=gen)
    whole = CppAttention.prefill_attention(q, k_cache, v_cache, tables, torch.tensor([0, length], dtype=torch.int32),
                                           torch.tensor([length], dtype=torch.int32), 0.125, window)
    # the last 40 rows as a chunk after a cached prefix of 110, in one call with a chunk of 30 other rows
    other_q = torch.randn(30, NUM_KV_HEADS * 3, 64, generator=gen)
    chunk = CppAttention.prefill_attention(torch.cat([q[110:], other_q]), k_cache, v_cache, tables.repeat(2, 1),
                                           torch.tensor([0, 40, 70], dtype=torch.int32),
                                           torch.tensor([length, 30], dtype=torch.int32), 0.125, window)
    assert torch.equal(chunk[:40], whole[110:])
    for row in (0, 1, 15, 16, 17, 64, 149):
        decoded = CppAttention.decode_attention(q[row:row + 1], k_cache, v_cache, tables,
                                                torch.tensor([row + 1], dtype=torch.int32), 0.125, window)
        assert torch.equal(decoded[0], whole[row]), row


@pytest.mark.parametrize("cache, group, softcap, head_dim", [("bfloat16", 3, 0.0, 64), ("bfloat16", 2, 0.0, 128),
                                                            ("float32", 1, 0.0, 64), ("int8", 3, 5.0, 64)])
def test_a_long_prompts_rows_in_blocks_get_the_bits_of_its_rows_decoded_one_by_one(cache, group, softcap, head_dim):
    # a prompt's rows attend a block of rows at a time (cpu_attention_prompt.h): each row's tiles of
    # keys and values are shared with its neighbours, its numbers must stay its own
    gen = torch.Generator().manual_seed(8)
    length = 700
    k_cache, v_cache, tables = paged_cache(gen, torch.float32, 16, head_dim, [length])
    if cache == "int8":
        k_cache, v_cache = int8_cache(k_cache), int8_cache(v_cache)
    else:
        k_cache, v_cache = k_cache.to(getattr(torch, cache)), v_cache.to(getattr(torch, cache))
    q = torch.randn(length, NUM_KV_HEADS * group, head_dim, generator=gen)
    whole = CppAttention.prefill_attention(q, k_cache, v_cache, tables, torch.tensor([0, length], dtype=torch.int32),
                                           torch.tensor([length], dtype=torch.int32), 0.125, 0, softcap)
    for row in (0, 15, 16, 31, 32, 63, 64, 65, 127, 128, 333, 639, 640, 699):
        decoded = CppAttention.decode_attention(q[row:row + 1], k_cache, v_cache, tables,
                                                torch.tensor([row + 1], dtype=torch.int32), 0.125, 0, softcap)
        assert torch.equal(decoded[0], whole[row]), row
    if cache == "bfloat16":  # the pair arithmetic (kernels/cpu_attention.cpp)
        expected = pair_reference(q, k_cache, v_cache, tables.expand(length, -1),
                                  torch.arange(1, length + 1, dtype=torch.int32), 0.125, 0, softcap)
    else:
        expected = paged_attention_torch.prefill_attention(q, k_cache, v_cache, tables,
                                                           torch.tensor([0, length], dtype=torch.int32),
                                                           torch.tensor([length], dtype=torch.int32), 0.125, 0, softcap)
    torch.testing.assert_close(whole, expected, rtol=1e-5, atol=PAIR_ATOL if cache == "bfloat16" else 1e-6)


def test_head_dims_that_are_not_a_multiple_of_the_lanes():
    check_decode(CppAttention, torch.float32, 16, 80, 3, seed=11)
    check_decode(CppAttention, torch.float32, 16, 24, 2, seed=12)


@pytest.mark.parametrize("window, softcap", [(0, 0.0), (21, 0.0), (0, 5.0)])
def test_int8_cache_matches_the_torch_path(window, softcap):
    gen = torch.Generator().manual_seed(3)
    context_lens = torch.tensor([1, 19, 64, 150], dtype=torch.int32)
    k_cache, v_cache, tables = paged_cache(gen, torch.float32, 16, 64, context_lens.tolist())
    k8, v8 = int8_cache(k_cache), int8_cache(v_cache)
    q = torch.randn(len(context_lens), NUM_KV_HEADS * 3, 64, generator=gen)

    out = CppAttention.decode_attention(q, k8, v8, tables, context_lens, 0.125, window, softcap)

    expected = paged_attention_torch.decode_attention(q, k8, v8, tables, context_lens, 0.125, window, softcap)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [0, 21])
def test_bfloat16_cache_matches_the_torch_path(window):
    gen = torch.Generator().manual_seed(5)
    context_lens = torch.tensor([1, 19, 64, 150], dtype=torch.int32)
    k_cache, v_cache, tables = paged_cache(gen, torch.bfloat16, 16, 64, context_lens.tolist())
    q = torch.randn(len(context_lens), NUM_KV_HEADS * 3, 64, generator=gen)

    out = CppAttention.decode_attention(q, k_cache, v_cache, tables, context_lens, 0.125, window)

    # the pair arithmetic (kernels/cpu_attention.cpp); the torch path keeps float32, within bfloat16's steps
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, pair_reference(q, k_cache, v_cache, tables, context_lens, 0.125, window),
                               rtol=1e-5, atol=PAIR_ATOL)
    torch.testing.assert_close(out, paged_attention_torch.decode_attention(q, k_cache, v_cache, tables, context_lens,
                                                                           0.125, window), rtol=0, atol=2e-2)


def test_a_sequence_gets_the_same_bits_alone_and_in_any_batch():
    gen = torch.Generator().manual_seed(4)
    context_lens = torch.tensor([7, 300, 45, 129, 1, 88], dtype=torch.int32)
    k_cache, v_cache, tables = paged_cache(gen, torch.float32, 16, 64, context_lens.tolist())
    q = torch.randn(len(context_lens), NUM_KV_HEADS * 4, 64, generator=gen)
    batch = CppAttention.decode_attention(q, k_cache, v_cache, tables, context_lens, 0.125)
    for i in range(len(context_lens)):
        alone = CppAttention.decode_attention(q[i:i + 1], k_cache, v_cache, tables[i:i + 1], context_lens[i:i + 1], 0.125)
        assert torch.equal(alone[0], batch[i])
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        other_threads = CppAttention.decode_attention(q, k_cache, v_cache, tables, context_lens, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(other_threads, batch)


def test_a_block_table_too_short_for_its_length_is_refused():
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache, tables = paged_cache(gen, torch.float32, 16, 64, [20])
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        CppAttention.decode_attention(torch.randn(1, NUM_KV_HEADS, 64), k_cache, v_cache, tables[:, :1],
                                   torch.tensor([40], dtype=torch.int32), 0.125)


def test_rms_norm_with_and_without_the_residual():
    from gpushare import kernels

    gen = torch.Generator().manual_seed(6)
    x, residual, weight = (torch.randn(*shape, generator=gen) for shape in ((37, 576), (37, 576), (576,)))
    normed, total = kernels.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(total, x + residual)
    torch.testing.assert_close(normed, torch.nn.functional.rms_norm(x + residual, (576,), weight, 1e-5),
                               rtol=1e-6, atol=1e-6)
    alone, same = kernels.rms_norm(x[3:4], weight, 1e-5)
    assert same is x[3:4] or torch.equal(same, x[3:4])
    torch.testing.assert_close(alone, torch.nn.functional.rms_norm(x[3:4], (576,), weight, 1e-5), rtol=1e-6, atol=1e-6)
    assert torch.equal(kernels.rms_norm(x, weight, 1e-5)[0][3:4], alone)  # a row alone or among others


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_rope_and_cache_is_the_torch_path_bit_for_bit(cache_dtype):
    from gpushare import kernels
    from gpushare.models.rope import apply_rope

    gen = torch.Generator().manual_seed(7)
    q_heads, kv_heads, dim, tokens, blocks, block_size = 9, 3, 64, 21, 8, 16
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, generator=gen)
    table = torch.randn(50, 2, dim, generator=gen)  # [cos, sin] rows per position, as the model's rope table
    positions = torch.randint(0, 50, (tokens,), generator=gen)
    cos, sin = table[positions][:, 0, None, :], table[positions][:, 1, None, :]
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]

    def caches():
        shape = (blocks, block_size, kv_heads, dim)
        if cache_dtype == torch.int8:
            return [Int8KV(torch.zeros(shape, dtype=torch.int8), torch.zeros(shape[:-1])) for _ in "kv"]
        return [torch.zeros(shape, dtype=cache_dtype) for _ in "kv"]

    expected_caches = caches()
    q, k, v = qkv.clone().split([q_heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    expected_q = apply_rope(q.reshape(tokens, q_heads, dim), cos, sin)
    expected_k = apply_rope(k.reshape(tokens, kv_heads, dim), cos, sin)
    paged_attention_torch.reshape_and_cache(expected_k, v.reshape(tokens, kv_heads, dim), *expected_caches, slots)

    fused_caches = caches()
    assert kernels.try_rope_and_cache(qkv, cos, sin, q_heads, kv_heads, *fused_caches, slots)

    assert torch.equal(qkv[:, :q_heads * dim].view(tokens, q_heads, dim), expected_q)
    for fused, expected in zip(fused_caches, expected_caches):
        if cache_dtype == torch.int8:
            assert torch.equal(fused.data, expected.data) and torch.equal(fused.scale, expected.scale)
        else:
            assert torch.equal(fused, expected)
