"""Tensor parallelism: which part of a model each of N ranks holds, and that part's weights.

Megatron's split: every rank holds some attention heads and a slice of the MLP. q/k/v and
gate/up are cut by output rows (column-parallel), o_proj and down_proj by input columns
(row-parallel), so each rank's o_proj and down_proj give a partial sum of the layer's output
and one all-reduce per block (``DecoderLayer.reduce``) makes it whole on every rank. lm_head is
vocab-parallel: each rank computes the logits of its slice of the vocabulary and the first rank
gathers them (for SmolLM2 at batch 1: half of a 3.9 ms lm_head plus a 0.1 ms gather, against the
whole of it on the first rank while the others wait: benchmarks/tensor_parallel.py). Norms and
the embedding are replicated: a row lookup costs nothing to repeat.

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

import torch

from gpushare.models.config import ModelConfig
from gpushare.models.quantized import INT4_GROUP_SIZE, Int4Weight, Int8Weight, permute_rows, stack_rows

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


def _rows(w, start: int, end: int):
    return permute_rows(w, torch.arange(start, end))


def _columns(w, start: int, end: int):
    """Input columns [start, end) of a dense or quantized weight (scales are per output row, and
    int4 groups are whole: ``split_model`` cuts on group boundaries)."""
    if isinstance(w, torch.Tensor):
        return w[:, start:end].contiguous()
    if isinstance(w, Int8Weight):
        return Int8Weight(w.qweight[:, start:end].contiguous(), w.scales)
    g = w.group_size
    if start % g or end % g:
        raise ValueError(f"an int4 weight in groups of {g} cannot be cut at columns {start}:{end}")
    return Int4Weight(w.qweight[:, start // 2:end // 2].contiguous(), w.scales[:, start // g:end // g].contiguous(),
                      w.mins[:, start // g:end // g].contiguous(), g)


def shard_state(state: dict, config: ModelConfig, part: RankSlice) -> dict:
    """One rank's weights from the whole model's Hugging Face-named state (as the loaders give it,
    q/k/v and gate/up apart, dense or quantized); everything not cut is shared, not copied."""
    d = config.head_dim
    out = dict(state)
    # lm_head is vocab-parallel; a tied embedding stays whole (a row lookup costs nothing to repeat).
    head = state.get("lm_head.weight", state.get("model.embed_tokens.weight"))
    out["lm_head.weight"] = _rows(head, *part.vocab)
    cuts = {
        "self_attn.q_proj": (_rows, part.q_heads[0] * d, part.q_heads[1] * d),
        "self_attn.k_proj": (_rows, part.kv_heads[0] * d, part.kv_heads[1] * d),
        "self_attn.v_proj": (_rows, part.kv_heads[0] * d, part.kv_heads[1] * d),
        "self_attn.o_proj": (_columns, part.q_heads[0] * d, part.q_heads[1] * d),
        "mlp.gate_proj": (_rows, *part.mlp),
        "mlp.up_proj": (_rows, *part.mlp),
        "mlp.down_proj": (_columns, *part.mlp),
    }
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        fused = state.get(prefix + "mlp.gate_up_proj.weight")  # Phi-3 ships gate|up as one matrix
        if fused is not None:
            (first, end), half = part.mlp, config.intermediate_size
            out[prefix + "mlp.gate_up_proj.weight"] = stack_rows([_rows(fused, first, end),
                                                                  _rows(fused, half + first, half + end)])
        for module, (cut, start, end) in cuts.items():
            key = f"{prefix}{module}.weight"
            if key in state:
                out[key] = cut(state[key], start, end)
            if f"{prefix}{module}.bias" in state:  # q/k/v biases (Qwen2); o and down have none
                out[f"{prefix}{module}.bias"] = state[f"{prefix}{module}.bias"][start:end]
    return out
