"""Linear and embedding layers over dense or quantized weights, each on the kernel that suits
its format and device.

A ``Linear`` holds one of:
- a dense weight (``F.linear``; on the CPU in float32 a oneDNN-packed copy, 1.1-2x faster
  than MKL for this model's shapes with identical results);
- an ``Int8Weight`` or ``Int4Weight``. On the CPU, where the C++ kernels build and measure faster
  (cpu_kernels.quantized_kernel), the weight is packed once for ``kernels/cpu_qmatmul``, which
  quantizes the activations to int8 in blocks of 32 (one scale per block, as llama.cpp) and
  multiplies in integers: 1.7x torch's weight-only kernels at batch 1, 3-4x at 16-64 here.
  Otherwise torch's weight-only kernels on bfloat16 activations (``_weight_int8pack_mm``,
  ``_weight_int4pack_mm_for_cpu``; their float32 paths are reference loops, 10 to 150x slower),
  with wide prefill rows of int8 weights on a dequantized bfloat16 copy. On CUDA the Triton kernels.

One int8 scale per token instead of per block was 2.5x faster than the weight-only kernels at
batch 16 but cost 6.4% perplexity on SmolLM2, whose hidden states carry ~25,000-magnitude outliers
that leave every other channel of a token a few int8 steps (docs/benchmarks.md).

Quantized tensors are registered buffers, so moving a model (the warm tier) moves them too.
"""

import torch
import torch.nn.functional as F
from torch import nn

from gpushare import kernels
from gpushare.kernels import cpu_qmatmul
from gpushare.models.cpu_kernels import quantized_kernel, wide_int8_kernel
from gpushare.models.int8_wide import int8_wide_matmul
from gpushare.models.quantized import Int4Weight, Int8Weight


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # host: the loader fills and moves it
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None  # host: as the weight
        self.format = "dense"  # dense | onednn | int8 | int4
        self.blocks = False  # int8 or int4 packed for kernels/cpu_qmatmul
        self.group_size = 0
        self.lora = None  # the loaded LoRA adapters' stacks (models/lora_table.LinearLora), None without any

    def forward(self, x, wide_rows: int = 0, lora_slots: torch.Tensor | None = None):
        """``wide_rows``: rows ``[0, wide_rows)`` belong to wide prefill chunks (cpu_kernels.WIDE_CHUNK_TOKENS
        tokens or more), which int8 weights on the CPU may compute on dequantized bfloat16 weights.
        ``lora_slots [rows]`` int32: each row's adapter slot (-1: none), added after the base product."""
        y = self._base(x, wide_rows)
        if self.lora is not None and lora_slots is not None:
            self.lora.apply(y, x, lora_slots)
        return y

    def _base(self, x, wide_rows: int):
        kind = self.format
        if kind == "dense":
            w = self.weight  # bfloat16 weights under float32 activations: compute in the weights' dtype
            y = F.linear(x, w) if w.dtype == x.dtype else F.linear(x.to(w.dtype), w).to(x.dtype)
        elif kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        elif self.blocks:
            y = cpu_qmatmul.matmul(x.float(), self.codes, self.scales, self.mins, self.out_features).to(x.dtype)
        elif kind == "int8":
            if x.is_cuda:
                y = kernels.int8_weight_matmul(x, self.qweight, self.scales)
            elif wide_rows and wide_int8_kernel() == "bfloat16":
                y = int8_wide_matmul(x.to(torch.bfloat16), self.qweight, self.scales_bf16, wide_rows).to(x.dtype)
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

    @property
    def kernel(self) -> str:
        """The kernel this linear runs on, as listings name it (``gpushare ps``, ``/api/show``)."""
        if self.blocks:  # with the instructions its build runs: avx512-vnni, avx-vnni, avx2 or portable
            return f"cpu-blocks-{cpu_qmatmul.kernel()}"
        if self.format in ("int8", "int4"):
            return "triton" if next(self.buffers()).is_cuda else f"torch-{self.format}pack"
        return "onednn" if self.format == "onednn" else "torch-dense"

    def set_dense(self, weight: torch.Tensor) -> None:
        self.weight = nn.Parameter(weight, requires_grad=False)
        if weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available():
            # oneDNN's layout replaces the dense copy: one copy of the weight in memory
            self.register_buffer("packed", weight.detach().to_mkldnn(), persistent=False)
            self.weight = None
            self.format = "onednn"

    def set_quantized(self, w: Int8Weight | Int4Weight, device: str, cpu_kernel: str | None = None) -> None:
        """``cpu_kernel``: "blocks" or "torch" on the CPU; None: this machine's (cpu_kernels.quantized_kernel)."""
        self.weight = None
        in_blocks = cpu_qmatmul.fits(*w.shape) and (isinstance(w, Int8Weight) or w.group_size == cpu_qmatmul.BLOCK)
        if device == "cpu" and in_blocks and (cpu_kernel or quantized_kernel()) == "blocks":
            self._set_blocks(w)
        elif isinstance(w, Int8Weight):
            self.register_buffer("scales", w.scales.to(device), persistent=False)
            self.register_buffer("qweight", w.qweight.to(device), persistent=False)
            if device == "cpu":
                self.register_buffer("scales_bf16", w.scales.bfloat16(), persistent=False)
            self.format = "int8"
        else:
            self._set_int4(w, device)

    def _set_blocks(self, w: Int8Weight | Int4Weight) -> None:
        self.blocks = True
        if isinstance(w, Int8Weight):
            self.format, codes, scales, mins = "int8", cpu_qmatmul.pack_int8(w.qweight), w.scales.float(), None
        else:
            self.format, self.group_size = "int4", w.group_size
            codes, scales, mins = cpu_qmatmul.pack_int4(w.nibbles(), w.scales, w.mins)
        for name, tensor in (("codes", codes), ("scales", scales.contiguous()), ("mins", mins)):
            self.register_buffer(name, tensor, persistent=False)

    def _set_int4(self, w: Int4Weight, device: str) -> None:
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

    def dequantized_rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of the weight in ``dtype``: the embedding lookup of a tied int8 matrix."""
        if self.format == "int8" and self.blocks:
            return cpu_qmatmul.int8_rows(self.codes, self.scales, self.in_features, ids).to(dtype)
        if self.format == "int8":
            return (self.qweight[ids].to(torch.float32) * self.scales[ids, None]).to(dtype)
        raise ValueError(f"no row lookup for {self.format} weights")


class Embedding(nn.Module):
    """Token embeddings; a quantized model looks rows up in its tied, quantized lm_head."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))  # host: the loader fills and moves it
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
    if module.blocks:
        names = ["codes", "scales", "mins"]
    elif module.format == "int4":
        names = ["packed", "scales_and_zeros"] if hasattr(module, "packed") else ["qweight", "scales", "mins"]
    else:
        names = {"dense": ["weight"], "onednn": ["packed"], "int8": ["qweight", "scales", "scales_bf16"]}[module.format]
    tensors = [getattr(module, n, None) for n in names]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
