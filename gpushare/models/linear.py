"""Linear and embedding layers over dense or quantized weights, each on the kernel that suits
its format and device.

A ``Linear`` holds one of:
- a dense weight (``F.linear``; on the CPU in float32 a oneDNN-packed copy, 1.1-2x faster
  than MKL for this model's shapes with identical results);
- an ``Int8Weight``: on the CPU ``_weight_int8pack_mm`` (weight-only), on CUDA the Triton kernel;
- an ``Int4Weight``: on the CPU ``_weight_int4pack_mm_for_cpu`` (its own packed layout, made
  once at load), on CUDA the Triton kernel.

The CPU kernels take bfloat16 activations: their float32 paths are reference loops, 10 to 150x
slower here; the result is cast back to the activations' dtype. Activations are not quantized:
int8 activations per token (``torch._int_mm``) were 2.5x faster at batch 16 but cost 6.4%
perplexity on SmolLM2, whose hidden states carry ~25,000-magnitude outliers that leave every
other channel of a token a few int8 steps (docs/benchmarks.md).

Quantized tensors are registered buffers, so moving a model (the warm tier) moves them too.
"""

import threading

import torch
import torch.nn.functional as F
from torch import nn

from gpushare import kernels
from gpushare.models.cpu_kernels import wide_int8_kernel
from gpushare.models.quantized import Int4Weight, Int8Weight


WIDE_TILE_ELEMENTS = 1 << 22  # a dequantized tile of an int8 weight: 8 MiB of bfloat16
_wide_scratch = threading.local()  # per engine thread: the tile's buffer, reused by every call


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.format = "dense"  # dense | onednn | int8 | int4
        self.group_size = 0

    def forward(self, x, wide_rows: int = 0):
        """``wide_rows``: rows ``[0, wide_rows)`` belong to wide prefill chunks (cpu_kernels.WIDE_CHUNK_TOKENS
        tokens or more), which int8 weights on the CPU may compute on dequantized bfloat16 weights."""
        kind = self.format
        if kind == "dense":
            w = self.weight  # bfloat16 weights under float32 activations: compute in the weights' dtype
            y = F.linear(x, w) if w.dtype == x.dtype else F.linear(x.to(w.dtype), w).to(x.dtype)
        elif kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        elif kind == "int8":
            if x.is_cuda:
                y = kernels.int8_weight_matmul(x, self.qweight, self.scales)
            elif wide_rows and wide_int8_kernel() == "bfloat16":
                y = self._int8_wide(x.to(torch.bfloat16), wide_rows).to(x.dtype)
            else:
                y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scales_bf16)
                y = y.to(x.dtype)
        else:
            if x.is_cuda:
                y = kernels.int4_weight_matmul(x, self.qweight, self.scales, self.mins, self.group_size)
            else:
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, self.group_size,
                                                               self.scales_and_zeros).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def set_dense(self, weight: torch.Tensor) -> None:
        self.weight = nn.Parameter(weight, requires_grad=False)
        if weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available():
            # oneDNN's layout replaces the dense copy: one copy of the weight in memory
            self.register_buffer("packed", weight.detach().to_mkldnn(), persistent=False)
            self.weight = None
            self.format = "onednn"

    def set_quantized(self, w: Int8Weight | Int4Weight, device: str) -> None:
        self.weight = None
        if isinstance(w, Int8Weight):
            self.register_buffer("scales", w.scales.to(device), persistent=False)
            self.register_buffer("qweight", w.qweight.to(device), persistent=False)
            if device == "cpu":
                self.register_buffer("scales_bf16", w.scales.bfloat16(), persistent=False)
            self.format = "int8"
            return
        self.group_size, self.format = w.group_size, "int4"
        if device == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.nibbles(), 1)
            # the CPU kernel computes (q - 8) * scale + zero: zero = min + 8 * scale
            scales_and_zeros = torch.stack([w.scales, w.mins + 8 * w.scales], dim=-1).transpose(0, 1)
            scales_and_zeros = scales_and_zeros.to(torch.bfloat16).contiguous()
            self.register_buffer("packed", packed, persistent=False)
            self.register_buffer("scales_and_zeros", scales_and_zeros, persistent=False)
        else:
            for name in ("qweight", "scales", "mins"):
                self.register_buffer(name, getattr(w, name).to(device), persistent=False)

    def _int8_wide(self, x: torch.Tensor, wide_rows: int) -> torch.Tensor:
        """bfloat16 ``x``'s wide rows through a bfloat16 GEMM on the weight dequantized for this call, a
        tile of output channels at a time into the thread's scratch (a fresh multi-MB tensor per call
        costs its page faults: 778 against 194 us for a 960 x 576 weight at 64 rows); the other rows
        through the decode kernel. A row's result does not depend on how many rows there are."""
        n, k = self.qweight.shape
        tile = min(n, max(1, WIDE_TILE_ELEMENTS // k))
        scratch = getattr(_wide_scratch, "tile", None)
        if scratch is None or scratch.numel() < tile * k:
            scratch = _wide_scratch.tile = torch.empty(tile * k, dtype=torch.bfloat16)
        parts = []
        for start in range(0, n, tile):
            end = min(n, start + tile)
            weight = torch.mul(self.qweight[start:end], self.scales_bf16[start:end, None],
                               out=scratch[:(end - start) * k].view(end - start, k))
            parts.append(F.linear(x[:wide_rows], weight))
        wide = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        if wide_rows == x.shape[0]:
            return wide
        return torch.cat([wide, torch.ops.aten._weight_int8pack_mm(x[wide_rows:], self.qweight, self.scales_bf16)])

    def dequantized_rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of the weight in ``dtype``: the embedding lookup of a tied int8 matrix."""
        if self.format == "int8":
            return (self.qweight[ids].to(torch.float32) * self.scales[ids, None]).to(dtype)
        raise ValueError(f"no row lookup for {self.format} weights")


class Embedding(nn.Module):
    """Token embeddings; a quantized model looks rows up in its tied, quantized lm_head."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        self.row_lookup = None  # a quantized Linear's dequantized_rows, when it holds the same matrix

    def forward(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.row_lookup is not None:
            return self.row_lookup(ids, dtype)
        if self.weight is None:  # its own int8 rows
            return (self.qweight[ids].to(torch.float32) * self.scales[ids, None]).to(dtype)
        return F.embedding(ids, self.weight)

    def set_quantized(self, w: Int8Weight, device: str) -> None:
        self.weight = None
        self.register_buffer("qweight", w.qweight.to(device), persistent=False)
        self.register_buffer("scales", w.scales.to(device), persistent=False)


def linear_bytes(module: Linear) -> int:
    """Bytes of the weight as stored (packed and quantized forms included, the bias not)."""
    if module.format == "int4":
        names = ["packed", "scales_and_zeros"] if hasattr(module, "packed") else ["qweight", "scales", "mins"]
    else:
        names = {"dense": ["weight"], "onednn": ["packed"], "int8": ["qweight", "scales", "scales_bf16"]}[module.format]
    tensors = [getattr(module, n, None) for n in names]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
