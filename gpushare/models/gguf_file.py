"""Read a GGUF file's tensors under Hugging Face names, dequantised to float32 or converted one by
one into the model's weight format (gpushare.protocol.weight_format). The header (metadata, tensor
table) is gguf_reader.open_gguf's."""

import numpy as np
import torch

from gpushare.protocol import weight_format
from gpushare.models.dequant import dequantize
from gpushare.catalog.gguf_reader import GGUFError
from gpushare.models.quantized import Int4Weight, int4_from_gguf, permute_rows, quantize, stack_rows

QUANTIZE_ROWS = 4096  # rows dequantized at a time on the way to int8 or int4

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: fused already
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "attn_output_norm",  # Gemma 2/3 (llama.cpp stores its norms with the 1 added)
    "post_ffw_norm": "mlp_output_norm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "cls.output.weight": "lm_head.weight",  # an LLM reranker's head: the yes and no rows only (yes_no_head)
    "rope_freqs.weight": "rope_freqs",
    "rope_factors_long.weight": "rope_factors_long",
    "rope_factors_short.weight": "rope_factors_short",
}


def _hf_name(gguf_name: str, gate_up_fused: bool = False) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        # Phi-3's ffn_up holds gate and up stacked, gate first, as our fused module does.
        layer_name = "mlp.gate_up_proj" if gate_up_fused and parts[2] == "ffn_up" else _LAYER_NAMES[parts[2]]
        return f"model.layers.{parts[1]}.{layer_name}.{parts[3]}"
    return None


def unpermute_order(rows: int, num_heads: int) -> torch.Tensor:
    """Row order undoing llama.cpp's Q/K permutation (it interleaves each head's rotary halves into pairs)."""
    order = torch.arange(rows)  # host: indexes the host weights being read
    return order.reshape(num_heads, rows // num_heads // 2, 2).transpose(1, 2).reshape(rows)


def _dense(data, type_name: str, shape: list[int]) -> torch.Tensor:
    """float32 ``shape`` from a tensor's ``data`` (all its rows, or some of them) of GGUF type ``type_name``."""
    if type_name in ("F32", "F16"):
        return torch.from_numpy(np.array(data, dtype=np.float32).reshape(shape))  # host: read from the file
    weights = dequantize(data, type_name, shape)
    if weights is None:
        # the gguf package for the types without a decoder of ours, imported only then: with its
        # vocabulary helpers (sentencepiece) it holds ~4 MiB of a worker's memory for good
        from gguf import GGMLQuantizationType, quants

        weights = torch.from_numpy(  # host: read from the file
            quants.dequantize(np.asarray(data), GGMLQuantizationType[type_name]).reshape(shape))
    return weights


def _convert(tensor, name: str, shape: list[int], weights: str):
    """One tensor in the model's format: float32, or quantized straight from its blocks where they
    map exactly (Q4_0/Q4_1 -> int4), else through float32 copies of QUANTIZE_ROWS rows at a time
    (so that a load's peak stays near the model's final size: for SmolLM2's Q8_0 embedding, 9 MB
    at once rather than 113 MB and its temporaries)."""
    target = weight_format.target_of(name, weights)
    type_name = tensor.tensor_type.name
    if target is None:
        return _dense(tensor.data, type_name, shape)
    if target == "int4":
        exact = int4_from_gguf(tensor.data, type_name, shape)
        if exact is not None:
            return exact
    rows = tensor.data.reshape(shape[0], -1)  # a row's blocks are contiguous in every GGUF type
    chunks = (_dense(rows[start:start + QUANTIZE_ROWS], type_name, [min(QUANTIZE_ROWS, shape[0] - start), shape[1]])
              for start in range(0, shape[0], QUANTIZE_ROWS))
    first = quantize(name, next(chunks), target)  # logs a fallback to int8 once, if any
    done = "int4" if isinstance(first, Int4Weight) else "int8"
    return stack_rows([first, *(quantize(name, chunk, done) for chunk in chunks)])


def read_tensors(tensors: list, path: str, num_heads: int, num_kv_heads: int, permuted_qk: bool, progress=None,
                 weights: str = "float32", gate_up_fused: bool = False, place=None) -> dict:
    """Every known tensor, in numpy (row-major, HF) shape order: float32, or for ``weights`` int8 /
    int4 the linear weights quantized as they are read (gpushare.protocol.weight_format).

    ``place(name, value)``, when given, puts each converted tensor where the model will use it (the
    device) before the next is read, so the host holds one tensor at a time, not the model.
    ``progress(done_bytes, total_bytes)``, when given, is called after each tensor.
    """
    total = sum(int(t.n_bytes) for t in tensors)
    done, state = 0, {}
    for tensor in tensors:
        name = _hf_name(tensor.name, gate_up_fused)
        if name is None:
            continue
        shape = [int(d) for d in reversed(tensor.shape)]  # ggml lists dims fastest-first
        try:
            value = _convert(tensor, name, shape, weights)
        except Exception as e:
            raise GGUFError(f"{path}: cannot read tensor {tensor.name} ({tensor.tensor_type.name}): {e}") from e
        if permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = num_heads if name.endswith("q_proj.weight") else num_kv_heads
            value = permute_rows(value, unpermute_order(shape[0], heads))
        value = value.contiguous() if isinstance(value, torch.Tensor) else value
        state[name] = value if place is None else place(name, value)
        del value  # the host copy goes now, not when the next tensor replaces it
        done += int(tensor.n_bytes)
        if progress is not None:
            progress(done, total)
    return state
