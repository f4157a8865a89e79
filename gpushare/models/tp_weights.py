"""Tensor parallelism: each rank's part of a model's weights (the split itself, which heads, MLP
channels and vocabulary rows each of N ranks holds, is catalog/tensor_split.py's).

Megatron's split: every rank holds some attention heads and a slice of the MLP. q/k/v and
gate/up are cut by output rows (column-parallel), o_proj and down_proj by input columns
(row-parallel), so each rank's o_proj and down_proj give a partial sum of the layer's output
and one all-reduce per block (``DecoderLayer.reduce``) makes it whole on every rank. lm_head is
vocab-parallel: each rank computes the logits of its slice of the vocabulary and the first rank
gathers them (for SmolLM2 at batch 1: half of a 3.9 ms lm_head plus a 0.1 ms gather, against the
whole of it on the first rank while the others wait: benchmarks/tensor_parallel.py). Norms and
the embedding are replicated: a row lookup costs nothing to repeat.
"""

from __future__ import annotations

import torch

from gpushare.catalog.model_config import ModelConfig
from gpushare.models.quantized import Int4Weight, Int8Weight, permute_rows, stack_rows
from gpushare.catalog.tensor_split import RankSlice


def _rows(w, start: int, end: int):
    return permute_rows(w, torch.arange(start, end))  # host: splits the host weights at load


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
