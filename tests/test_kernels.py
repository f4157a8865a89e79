"""Paged-attention kernels against a float64 reference written here.

Both implementations are checked: the Triton kernels (run by Triton's interpreter on CPU,
``TRITON_INTERPRET=1``) and the torch path. Every case is a random ragged batch whose
blocks are shuffled over the pool. Cache rows no sequence owns hold NaN, table entries
past a sequence's blocks point at an all-NaN block, and every float buffer the functions
allocate starts as NaN: reading garbage or leaving an element unwritten fails the test.
Error is max |out - ref| / max |ref|: <= 1e-5 for fp32, <= 1e-2 for fp16 and bf16 (bf16
output rounding alone reaches 2^-8, 2^-7 under the interpreter, which truncates).
"""

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest
import torch

from gpushare import kernels
from gpushare.kernels import cpu_ops, paged_attention_torch
from gpushare.kernels import paged_attention_triton
from gpushare.kernels.paged_attention_torch import Int8KV

NUM_KV_HEADS = 2
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in TOLERANCE]
IMPLS = [pytest.param(paged_attention_triton, id="triton"), pytest.param(paged_attention_torch, id="torch")]
# (block_size, head_dim): both block sizes, both head dims.
LAYOUTS = [pytest.param(16, 64, id="bs16-d64"), pytest.param(32, 128, id="bs32-d128")]
GROUPS = [pytest.param(g, id=f"gqa{g}") for g in (1, 3, 8)]


class CppAttention:
    """The CPU's C++ attention (kernels/cpu_attention.cpp, float32 queries) with the torch path's
    signatures, so the shared checks can call it; a prompt's rows go through it as the decode rows they would be."""

    @staticmethod
    def _loaded():
        if cpu_ops._compiler() is None:
            pytest.skip("no C++ compiler here: the CPU runs the torch path")
        assert cpu_ops.loaded(), "the C++ kernels did not build (see the log)"

    @staticmethod
    def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, window=0, softcap=0.0):
        CppAttention._loaded()
        k_scale = v_scale = None
        if isinstance(k_cache, Int8KV):
            k_cache, k_scale, v_cache, v_scale = k_cache.data, k_cache.scale, v_cache.data, v_cache.scale
        return torch.ops.gpushare.decode_attention(q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens,
                                                   scale, window, softcap)

    @staticmethod
    def prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, window=0, softcap=0.0):
        CppAttention._loaded()
        assert q.dtype == torch.float32 and not os.environ.get("GPUSHARE_KERNELS")
        return kernels.prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, window,
                                         softcap)


def ragged_lengths(gen, count, block_size, low, high):
    """``count`` lengths in [low, high], none a multiple of the block size."""
    lengths = torch.randint(low, high + 1, (count,), generator=gen).tolist()
    return [n - 1 if n % block_size == 0 else n for n in lengths]


def paged_cache(gen, dtype, block_size, head_dim, context_lens, garbage=float("nan")):
    """K/V caches holding ``context_lens`` random rows per sequence in shuffled blocks.

    Returns (k_cache, v_cache, block_tables int32). Unowned rows hold ``garbage``, and table
    entries past a sequence's blocks point at a block of nothing else.
    """
    owned = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(owned) + 3  # + the garbage block + two never used
    order = torch.randperm(num_blocks, generator=gen).tolist()
    garbage_block, free = order[0], order[1:]
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    k_cache = torch.full(shape, garbage, dtype=dtype)
    v_cache = torch.full(shape, garbage, dtype=dtype)
    block_tables = torch.full((len(context_lens), max(owned) + 1), garbage_block, dtype=torch.int32)
    for i, (length, count) in enumerate(zip(context_lens, owned)):
        block_tables[i, :count] = torch.tensor(free[:count], dtype=torch.int32)
        free = free[count:]
        blocks, offsets = token_slots(block_tables[i], block_size, length)
        k_cache[blocks, offsets] = torch.randn(length, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
        v_cache[blocks, offsets] = torch.randn(length, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
    return k_cache, v_cache, block_tables


def token_slots(table, block_size, length):
    """(block, offset) of each of a sequence's first ``length`` tokens."""
    positions = torch.arange(length)
    return table[positions // block_size].long(), positions % block_size


def cached_rows(cache, table, length):
    """One sequence's first ``length`` rows, token by token, as float64 ``[L, Hkv, D]``."""
    blocks, offsets = token_slots(table, cache.shape[1], length)
    return cache[blocks, offsets].double()


def reference_attention(q, keys, values, positions, scale):
    """Query rows ``[n, Hq, D]`` at ``positions`` attend to keys at positions <= theirs."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)  # query head h reads KV head h // group
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->nhl", q.double(), keys) * scale
    hidden = torch.arange(keys.shape[0])[None, :] > positions[:, None]
    scores = scores.masked_fill(hidden[:, None, :], float("-inf"))
    return torch.einsum("nhl,lhd->nhd", torch.softmax(scores, dim=-1), values)


def relative_error(out, ref):
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def assert_close(out, ref, dtype):
    assert out.dtype == dtype
    assert not out.isnan().any(), "unwritten or NaN-polluted output elements"
    assert relative_error(out, ref) <= TOLERANCE[dtype]


@pytest.fixture
def small_decode_segments(monkeypatch):
    """Segments of 64 tokens in tiles of 32: contexts here span several, so the merge runs."""
    monkeypatch.setattr(paged_attention_triton, "SEGMENT_TOKENS", 64)
    monkeypatch.setattr(paged_attention_triton, "DECODE_TILE_TOKENS", 32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_reshape_and_cache_writes_exactly_its_slots(impl, dtype, block_size):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, head_dim, num_tokens = 5, 64, 37
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    # Keys arrive as a strided view (the q/k/v split of a fused projection) and in fp32.
    qkv = torch.randn(num_tokens, 3 * NUM_KV_HEADS, head_dim, generator=gen)
    key, value = qkv[:, :NUM_KV_HEADS], qkv[:, NUM_KV_HEADS:2 * NUM_KV_HEADS].to(dtype)

    impl.reshape_and_cache(key, value, k_cache, v_cache, slots)

    flat_k, flat_v = k_cache.view(-1, NUM_KV_HEADS, head_dim), v_cache.view(-1, NUM_KV_HEADS, head_dim)
    # The interpreter truncates fp32 -> bf16 where the GPU rounds to nearest: allow one bf16 ulp.
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(flat_k[slots].float(), key.to(dtype).float(), rtol=ulp, atol=0)
    assert torch.equal(flat_v[slots], value)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


def check_decode(impl, dtype, block_size, head_dim, group, seed, garbage=float("nan")):
    gen = torch.Generator().manual_seed(seed)
    context_lens = [1] + ragged_lengths(gen, 3, block_size, 2, 150)
    k_cache, v_cache, block_tables = paged_cache(gen, dtype, block_size, head_dim, context_lens, garbage)
    q = torch.randn(len(context_lens), NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5

    out = impl.decode_attention(q, k_cache, v_cache, block_tables, torch.tensor(context_lens, dtype=torch.int32),
                                scale)

    ref = torch.cat([
        reference_attention(q[i:i + 1], cached_rows(k_cache, block_tables[i], n),
                            cached_rows(v_cache, block_tables[i], n), torch.tensor([n - 1]), scale)
        for i, n in enumerate(context_lens)
    ])
    assert_close(out, ref, dtype)


@pytest.mark.usefixtures("nan_allocations")
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("block_size, head_dim", LAYOUTS)
def test_decode_matches_reference(impl, dtype, group, block_size, head_dim):
    check_decode(impl, dtype, block_size, head_dim, group, seed=block_size * 10 + group)


@pytest.mark.usefixtures("nan_allocations")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("block_size, head_dim", LAYOUTS)
def test_torch_decode_matches_reference_over_finite_garbage(dtype, group, block_size, head_dim):
    check_decode(paged_attention_torch, dtype, block_size, head_dim, group, seed=block_size * 10 + group,
                 garbage=1000.0)


@pytest.mark.usefixtures("nan_allocations", "small_decode_segments")
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("block_size, head_dim", LAYOUTS)
def test_triton_decode_merges_segments(group, block_size, head_dim):
    check_decode(paged_attention_triton, torch.float32, block_size, head_dim, group, seed=block_size * 10 + group + 1)


@pytest.mark.usefixtures("nan_allocations", "small_decode_segments")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_triton_decode_merges_segments_in_half_precision(dtype):
    check_decode(paged_attention_triton, dtype, 16, 64, 3, seed=5)


@pytest.mark.usefixtures("nan_allocations", "small_decode_segments")
def test_triton_decode_grows_segments_past_the_segment_cap(monkeypatch):
    # Seed 13 draws lengths up to 148: an 11-block table (176 tokens) that would take 3
    # segments of 64; capped at 2, segments grow to 96 tokens (three 32-token tiles).
    monkeypatch.setattr(paged_attention_triton, "MAX_SEGMENTS", 2)
    check_decode(paged_attention_triton, torch.float32, 16, 64, 3, seed=13)


def check_prefill(impl, dtype, block_size, head_dim, group, seed):
    gen = torch.Generator().manual_seed(seed)
    # A whole prompt, a later chunk after a cached prefix, and a one-token chunk.
    prompt_len = ragged_lengths(gen, 1, block_size, 20, 70)[0]
    chunk_len, prefix_len = torch.randint(5, 30, (1,), generator=gen).item(), 2 * block_size + 5
    single_ctx = ragged_lengths(gen, 1, block_size, 2, 60)[0]
    q_lens = [prompt_len, chunk_len, 1]
    context_lens = [prompt_len, prefix_len + chunk_len, single_ctx]
    k_cache, v_cache, block_tables = paged_cache(gen, dtype, block_size, head_dim, context_lens)
    q = torch.randn(sum(q_lens), NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype)
    cu_seqlens_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = head_dim ** -0.5

    out = impl.prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                 torch.tensor(context_lens, dtype=torch.int32), scale)

    ref = torch.cat([
        reference_attention(q[cu_seqlens_q[i]:cu_seqlens_q[i + 1]], cached_rows(k_cache, block_tables[i], n),
                            cached_rows(v_cache, block_tables[i], n), torch.arange(n - q_len, n), scale)
        for i, (q_len, n) in enumerate(zip(q_lens, context_lens))
    ])
    assert_close(out, ref, dtype)


@pytest.mark.usefixtures("nan_allocations")
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("block_size, head_dim", LAYOUTS)
def test_prefill_matches_reference(impl, dtype, group, block_size, head_dim):
    check_prefill(impl, dtype, block_size, head_dim, group, seed=block_size * 10 + group + 2)


@pytest.mark.usefixtures("nan_allocations")
@pytest.mark.parametrize("impl", IMPLS)
def test_decode_head_dim_that_is_not_a_power_of_two(impl):
    check_decode(impl, torch.float32, 16, 80, 3, seed=11)


@pytest.mark.usefixtures("nan_allocations")
@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_head_dim_that_is_not_a_power_of_two(impl):
    check_prefill(impl, torch.float32, 16, 80, 3, seed=12)
