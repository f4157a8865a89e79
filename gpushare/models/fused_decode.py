"""The fused path: a step's rows run their layers a few at a time in one C++ call
(``kernels/cpu_decode.cpp``) where the model allows it, with the same numbers as layer by layer.

Why: on the CPU a decode step at batch 1 is ~150 short parallel regions. Run from Python, each
pays for the intra-op thread falling asleep in the gap before it (the workers' short OpenMP spin,
kept short so that an idle engine leaves the cores to the API and other models); in one C++ call
the threads run every kernel as one team and stay awake (kernels/cpu_team.h). Prompt chunks ride along: the C++
attention takes every row as the decode row it would be (``AttentionBatch.rows``), so a step that
admits a new prompt among running streams is one call too.

It takes a model whose every layer is SmolLM2's and Llama's shape: SwiGLU, no biases, no q/k or
sandwich norms, one RoPE, every linear on the block kernel (int8 or int4), float32 activations, no
tensor parallel. Anything else runs layer by layer. The call that ends with the last layer also runs the
final norm and the LM head of the rows that sample (``ForwardState.logit_rows``) where the LM head is on
the block kernel too, so that the step's largest matrix is read by threads already awake. LoRA adapters ride along: the call adds each row's
adapter after each target linear (kernels/cpu_lora.cpp, the kernel the layer by layer path calls). A step
may still pause between two calls for an urgent prompt.
"""

from dataclasses import dataclass

import torch

from gpushare import kernels
from gpushare.models.pause_signal import PauseSignal

# A step may pause for an urgent prompt (Engine.take_new_work). Given the engine's PauseSignal a call
# reads it after each layer and stops there when it is set, so a pause waits one layer; any other
# callable is asked between two calls. A call runs at most 32 layers and 64 rows x layers: a whole
# step at batch 1 (~4 ms; five layers a call took 4.7 ms a step against 3.8 whole, each gap between
# calls a wake of a sleeping thread, slow in a VM), five layers at 12 rows, one from 64 rows on. The
# gaps between calls are what leave the API process the cores under a 429 storm: with whole steps at
# 12 rows a victim's TTFT p99 was 137-147 ms, against 106 at five layers a call (docs/benchmarks.md).
LAYERS_PER_CALL = 32
ROW_LAYERS_PER_CALL = 64  # rows x layers


@dataclass
class DecodeWeights:
    """A model's layers as ``kernels.decode_layers`` takes them: flat lists, layer after layer."""

    norms: list[torch.Tensor]       # input and post-attention norm of each layer
    codes: list[torch.Tensor]       # qkv, o, gate_up, down of each layer
    scales: list[torch.Tensor]
    mins: list[torch.Tensor | None]  # None: int8
    out_features: list[int]
    windows: list[int]
    q_heads: int
    kv_heads: int
    eps: float
    attn_scale: float
    softcap: float
    head: tuple | None = None  # final norm, LM head codes, scales, mins, out features; None: not on the block kernel


def decode_weights(model) -> DecodeWeights | None:
    """The model's layers for the fused call, or None where one of them is not of the shape it takes."""
    config = model.config
    if config.qk_norm or config.sandwich_norm or config.hidden_act != "silu" or config.attention_bias:
        return None
    if model.rope_local is not None or model.norm.weight.dtype != torch.float32:
        return None
    weights = DecodeWeights([], [], [], [], [], [], config.num_heads, config.num_kv_heads, config.rms_norm_eps,
                            model.layers[0].self_attn.scale, config.attn_softcap or 0.0)  # every layer's alike
    for layer in model.layers:
        linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
        if layer.reduce is not None or not all(linear.blocks and linear.bias is None for linear in linears):
            return None
        weights.norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        weights.codes += [linear.codes for linear in linears]
        weights.scales += [linear.scales for linear in linears]
        weights.mins += [linear.mins for linear in linears]
        weights.out_features += [linear.out_features for linear in linears]
        weights.windows.append(layer.self_attn.window)
    head = model.lm_head
    if head.blocks and head.bias is None and head.lora is None and not config.lm_head_rows:  # whole, not a rank's slice
        weights.head = (model.norm.weight, head.codes, head.scales, head.mins, head.out_features)
    return weights


def run(weights: DecodeWeights, state, kv_caches, should_pause=None, adapters=None) -> bool | None:
    """Run the layers from ``state.next_layer`` on: True after the last one, False where ``should_pause``
    said so after a layer (as ``LlamaModel.run_layers``); None, with nothing done, where the kernels
    cannot (another device or dtype, no C++ build). A PauseSignal is read by the call after each layer,
    any other callable between two calls. The call with the last layer sets ``state.logits`` (the final norm
    and LM head of ``state.logit_rows``) where the weights have a head. A step with adapter rows
    (``state.batch.lora_slots``) adds them after each target linear from ``adapters``
    (models/lora_table.AdapterTable)."""
    batch, layers = state.batch, len(weights.windows)
    if state.x.dtype != torch.float32:
        return None
    lora = {}
    if batch.lora_slots is not None:
        lora = {"lora_a": adapters.a_stacks, "lora_b": adapters.b_stacks, "lora_slots": batch.lora_slots,
                "lora_scales": adapters.scale_of_slot}
    signal = should_pause.flag if isinstance(should_pause, PauseSignal) else None
    tables, lengths = batch.rows()
    per_call = max(1, min(LAYERS_PER_CALL, ROW_LAYERS_PER_CALL // max(1, state.x.shape[0])))
    head_rows = state.logit_rows if weights.head is not None else None
    while state.next_layer < layers:
        first, end = state.next_layer, min(layers, state.next_layer + per_call)
        ran = kernels.decode_layers(state.x, weights, kv_caches[first:end], state.cos, state.sin, batch.slot_mapping,
                                    tables, lengths, first, pause=signal, head_rows=head_rows if end == layers else None,
                                    **lora)
        if ran is None:
            return None
        state.x, state.next_layer = ran[0], first + ran[1]
        if state.next_layer == layers and head_rows is not None:
            state.logits = ran[2]
        if should_pause is not None and state.next_layer < layers and should_pause():
            return False
    return True
