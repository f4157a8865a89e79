"""Tensor parallelism's split of a model: which attention heads, MLP channels and vocabulary rows
each of N ranks holds (models/tp_weights.py cuts the weights to match). Torch-free: the
daemon's supervisor checks a configured split with it before any worker starts.

Heads go to ranks in whole KV groups (a KV head and the query heads that read it), as evenly as
they divide: SmolLM2's 3 KV heads over 2 ranks are 2 and 1. With fewer KV heads than ranks each
KV head is replicated over N / num_kv_heads ranks that split its query heads, which needs N to be
a multiple of num_kv_heads and the group's query heads a multiple of that. The earlier ranks hold
at least as many KV heads as the later ones, so rank 0's KV block is the largest and the other
ranks lay their smaller blocks out at its stride (engine/kv_pool.layer_views): one block id is
the same block on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gpushare.catalog.model_config import ModelConfig
from gpushare.protocol.weight_format import INT4_GROUP_SIZE

SPLIT_ALIGN = INT4_GROUP_SIZE  # MLP slices start on int4 group boundaries (and on SIMD widths)


@dataclass(frozen=True)
class RankSlice:
    rank: int
    world_size: int
    kv_heads: tuple[int, int]  # [first, end) of the model's KV heads this rank holds
    q_heads: tuple[int, int]  # [first, end) of its query heads
    mlp: tuple[int, int]  # [first, end) of the MLP's intermediate channels
    vocab: tuple[int, int]  # [first, end) of lm_head's rows (the vocabulary) it computes logits for


def _even_bounds(total: int, parts: int, align: int = 1) -> list[int]:
    """parts + 1 boundaries cutting ``total`` as evenly as ``align`` allows, larger parts first."""
    units = -(-total // align)
    per, extra = divmod(units, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(min(total, bounds[-1] + (per + (i < extra)) * align))
    return bounds


def split_model(config: ModelConfig, world_size: int, model: str = "the model") -> list[RankSlice]:
    """Each rank's part; ValueError naming ``model`` and the constraint when N ranks cannot split it."""
    n, kv, heads = world_size, config.num_kv_heads, config.num_heads
    if n < 1:
        raise ValueError(f"{model}: tensor_parallel must be at least 1, got {n}")
    group = heads // kv  # query heads per KV head
    if n <= kv:
        kv_bounds = _even_bounds(kv, n)
        kv_parts = [(kv_bounds[r], kv_bounds[r + 1]) for r in range(n)]
        q_parts = [(a * group, b * group) for a, b in kv_parts]
    else:
        copies = n // kv
        if n % kv or group % copies:
            raise ValueError(f"{model}: tensor_parallel {n} cannot split its {heads} attention heads "
                             f"({kv} KV heads): with more ranks than KV heads, tensor_parallel must be a multiple "
                             f"of {kv} whose quotient divides the {group} query heads of each KV head; "
                             f"use at most {kv}")
        per_rank = group // copies
        kv_parts = [(r // copies, r // copies + 1) for r in range(n)]
        q_parts = [(r * per_rank, (r + 1) * per_rank) for r in range(n)]
    if config.intermediate_size < n * SPLIT_ALIGN:
        raise ValueError(f"{model}: tensor_parallel {n} leaves less than {SPLIT_ALIGN} MLP channels per rank "
                         f"(intermediate_size {config.intermediate_size})")
    mlp = _even_bounds(config.intermediate_size, n, SPLIT_ALIGN)
    vocab = _even_bounds(config.vocab_size, n)
    return [RankSlice(r, n, kv_parts[r], q_parts[r], (mlp[r], mlp[r + 1]), (vocab[r], vocab[r + 1]))
            for r in range(n)]


def vocab_widths(config: ModelConfig, world_size: int) -> list[int]:
    """How many of lm_head's rows (the vocabulary) each rank holds."""
    return [p.vocab[1] - p.vocab[0] for p in split_model(config, world_size)]


def rank_config(config: ModelConfig, part: RankSlice) -> ModelConfig:
    """The config of one rank's model: its heads and MLP channels, all else as the whole model's."""
    return replace(config, num_heads=part.q_heads[1] - part.q_heads[0],
                   num_kv_heads=part.kv_heads[1] - part.kv_heads[0],
                   intermediate_size=part.mlp[1] - part.mlp[0], layer_windows=list(config.layer_windows),
                   lm_head_rows=part.vocab[1] - part.vocab[0],
                   rope_scaling=dict(config.rope_scaling))
