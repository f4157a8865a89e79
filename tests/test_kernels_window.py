"""Sliding windows and soft-capped scores in the paged-attention paths (Triton under its
interpreter, torch, and for decode the CPU's C++ kernel) against a float64 reference.

Table entries of blocks wholly before every query's window are set to -1, as the engine leaves
them once it has freed those blocks: a kernel that still reads them fails (an index error in
torch, NaN or garbage under the interpreter). Unowned cache rows hold NaN as in test_kernels.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest
import torch

from gpushare.kernels import paged_attention_torch, paged_attention_triton
from test_kernels import NUM_KV_HEADS, CppAttention, assert_close, cached_rows, paged_cache

IMPLS = [pytest.param(paged_attention_triton, id="triton"), pytest.param(paged_attention_torch, id="torch")]
ALL_IMPLS = IMPLS + [pytest.param(CppAttention, id="cpp")]
FREED = -1


def reference(q, keys, values, positions, scale, window, softcap):
    """Query rows at ``positions`` over keys in ``(position - window, position]``, capped scores."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->nhl", q.double(), keys) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    cols = torch.arange(keys.shape[0])[None, :]
    hidden = (cols > positions[:, None]) | (cols <= positions[:, None] - window)
    scores = scores.masked_fill(hidden[:, None, :], float("-inf"))
    return torch.einsum("nhl,lhd->nhd", torch.softmax(scores, dim=-1), values)


def free_out_of_window(block_tables, first_keys, block_size):
    """Mark each sequence's blocks that end before its first visible key as freed."""
    tables = block_tables.clone()
    for i, first in enumerate(first_keys):
        tables[i, :first // block_size] = FREED
    return tables


@pytest.mark.usefixtures("nan_allocations")
@pytest.mark.parametrize("impl", ALL_IMPLS)
@pytest.mark.parametrize("softcap", [0.0, 5.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("group", [1, 4])
def test_decode_attends_to_its_window_only(impl, softcap, group, monkeypatch):
    # Segments of 32 tokens: windows start mid-sequence, so some segments are skipped and merged.
    monkeypatch.setattr(paged_attention_triton, "SEGMENT_TOKENS", 32)
    monkeypatch.setattr(paged_attention_triton, "DECODE_TILE_TOKENS", 16)
    gen = torch.Generator().manual_seed(group + int(softcap))
    block_size, head_dim, window = 8, 32, 21
    context_lens = [5, 21, 22, 77, 130]  # shorter than, exactly and just past the window, far past it
    k_cache, v_cache, tables = paged_cache(gen, torch.float32, block_size, head_dim, context_lens)
    q = torch.randn(len(context_lens), NUM_KV_HEADS * group, head_dim, generator=gen)
    scale = head_dim ** -0.5
    freed = free_out_of_window(tables, [max(0, n - window) for n in context_lens], block_size)

    out = impl.decode_attention(q, k_cache, v_cache, freed, torch.tensor(context_lens, dtype=torch.int32), scale,
                                window, softcap)

    ref = torch.cat([reference(q[i:i + 1], cached_rows(k_cache, tables[i], n), cached_rows(v_cache, tables[i], n),
                               torch.tensor([n - 1]), scale, window, softcap) for i, n in enumerate(context_lens)])
    assert_close(out, ref, torch.float32)


@pytest.mark.usefixtures("nan_allocations")
@pytest.mark.parametrize("impl", ALL_IMPLS)
@pytest.mark.parametrize("softcap", [0.0, 5.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("group", [1, 4])
def test_prefill_attends_to_its_window_only(impl, softcap, group):
    gen = torch.Generator().manual_seed(10 + group + int(softcap))
    block_size, head_dim, window = 8, 32, 13
    # A whole prompt longer than the window, a chunk after a long cached prefix, a one-token chunk.
    q_lens, context_lens = [45, 11, 1], [45, 70, 33]
    k_cache, v_cache, tables = paged_cache(gen, torch.float32, block_size, head_dim, context_lens)
    q = torch.randn(sum(q_lens), NUM_KV_HEADS * group, head_dim, generator=gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = head_dim ** -0.5
    freed = free_out_of_window(tables, [max(0, n - q - window + 1) for q, n in zip(q_lens, context_lens)],
                               block_size)

    out = impl.prefill_attention(q, k_cache, v_cache, freed, cu, torch.tensor(context_lens, dtype=torch.int32),
                                 scale, window, softcap)

    ref = torch.cat([reference(q[cu[i]:cu[i + 1]], cached_rows(k_cache, tables[i], n),
                               cached_rows(v_cache, tables[i], n), torch.arange(n - q_len, n), scale, window, softcap)
                     for i, (q_len, n) in enumerate(zip(q_lens, context_lens))])
    assert_close(out, ref, torch.float32)


@pytest.mark.usefixtures("nan_allocations")
@pytest.mark.parametrize("impl", IMPLS)
def test_softcap_without_window_covers_the_whole_history(impl):
    gen = torch.Generator().manual_seed(3)
    block_size, head_dim = 16, 64
    context_lens = [3, 40]
    k_cache, v_cache, tables = paged_cache(gen, torch.float32, block_size, head_dim, context_lens)
    q = torch.randn(2, NUM_KV_HEADS * 2, head_dim, generator=gen) * 4  # large scores: the cap bites

    out = impl.decode_attention(q, k_cache, v_cache, tables, torch.tensor(context_lens, dtype=torch.int32),
                                head_dim ** -0.5, 0, 2.0)

    ref = torch.cat([reference(q[i:i + 1], cached_rows(k_cache, tables[i], n), cached_rows(v_cache, tables[i], n),
                               torch.tensor([n - 1]), head_dim ** -0.5, 1 << 30, 2.0)
                     for i, n in enumerate(context_lens)])
    assert_close(out, ref, torch.float32)
