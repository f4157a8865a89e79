"""Quantized weight storage: int8 per output channel and int4 in groups, made from dense tensors
or straight from GGUF blocks.

Both keep rows independent (every scale belongs to one output row), so the loader can
quantize q, k and v (or gate and up) one by one and fuse them by stacking rows, and undo
llama.cpp's Q/K row permutation on the quantized form. The layouts are the ones the kernels
in ``gpushare.kernels`` take:

- ``Int8Weight``: ``qweight`` int8 ``[N, K]``, ``scales`` float32 ``[N]``;
  ``w[n, k] = qweight[n, k] * scales[n]``.
- ``Int4Weight``: ``qweight`` uint8 ``[N, K // 2]`` (k = 2j in the low nibble of byte j,
  k = 2j + 1 in the high one), ``scales`` and ``mins`` float32 ``[N, K // group_size]``;
  ``w[n, k] = q[n, k] * scales[n, k // g] + mins[n, k // g]``. GGUF's Q4_0 and Q4_1 blocks map
  onto it exactly (group 32), and so do Q4_K's groups, so a 4-bit file loads as int4 with no
  rounding at all.
"""

import logging
from dataclasses import dataclass

import numpy as np
import torch

from gpushare.models.dequant import k_scales, shifted
from gpushare.protocol.weight_format import INT4_GROUP_SIZE

log = logging.getLogger("gpushare.models")



@dataclass
class Int8Weight:
    qweight: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales[:, None]


@dataclass
class Int4Weight:
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    group_size: int = INT4_GROUP_SIZE

    @property
    def shape(self) -> tuple[int, int]:
        return (self.qweight.shape[0], self.qweight.shape[1] * 2)

    def nibbles(self) -> torch.Tensor:
        """The 4-bit values as int32 ``[N, K]`` (0..15)."""
        q = self.qweight.to(torch.int32)
        return torch.stack([q & 0x0F, q >> 4], dim=-1).reshape(self.shape)

    def dequantize(self) -> torch.Tensor:
        g = self.group_size
        groups = self.nibbles().float().view(self.shape[0], -1, g)
        return (groups * self.scales[..., None] + self.mins[..., None]).reshape(self.shape)


QuantizedWeight = Int8Weight | Int4Weight


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8 (round to nearest)."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scales.contiguous())


def quantize_int4(w: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> Int4Weight:
    """Asymmetric group-wise 4-bit (min and step per group of ``group_size`` along K)."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"int4 needs the input size ({k}) to be a multiple of the group size ({group_size})")
    groups = w.float().reshape(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((groups - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8).reshape(n, k)
    return Int4Weight(_pack_nibbles(q), scales.contiguous(), lo.contiguous(), group_size)


def quantize(name: str, dense: torch.Tensor, target: str) -> QuantizedWeight:
    """``dense`` (the tensor ``name``) in the ``target`` format (weight_format.target_of); int4 falls
    back to int8 (with a logged reason) for a matrix whose input size is not a multiple of the group size."""
    if target == "int4" and dense.shape[1] % INT4_GROUP_SIZE == 0:
        return quantize_int4(dense)
    if target == "int4":
        log.warning("%s: input size %d is not a multiple of %d: stored as int8 instead of int4",
                    name, dense.shape[1], INT4_GROUP_SIZE)
    return quantize_int8(dense)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def int4_from_gguf(raw: np.ndarray, type_name: str, shape: list[int]) -> Int4Weight | None:
    """Q4_0 / Q4_1 / Q4_K blocks as an Int4Weight, bit for bit; None for other block types.

    Q4_0/Q4_1: a block is 32 weights of one row: an fp16 scale d (and for Q4_1 an fp16 min m), then
    16 bytes holding weight j in the low nibble of byte j and weight j + 16 in its high nibble.
    Q4_1: ``w = d * q + m``; Q4_0: ``w = d * (q - 8)``, i.e. min ``-8 d``. Q4_K: a super-block of
    256 weights is eight groups of 32 with 6-bit scales and mins under fp16 d and dmin:
    ``w = (d * sc) * q - (dmin * m)``, a group scale and min as float32 products, as ggml computes.
    """
    if type_name == "Q4_K":
        return _int4_from_q4_k(raw, shape)
    if type_name not in ("Q4_0", "Q4_1"):
        return None
    head = 4 if type_name == "Q4_1" else 2
    n, k = shape
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(-1, head + 16))  # host: file bytes
    d = blocks[:, 0:2].contiguous().view(torch.float16).float().reshape(n, k // 32)
    m = blocks[:, 2:4].contiguous().view(torch.float16).float().reshape(n, k // 32) if head == 4 else -8 * d
    qs = blocks[:, head:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1).reshape(n, k)  # ggml's order: j, then j + 16
    return Int4Weight(_pack_nibbles(q), d.contiguous(), m.contiguous(), 32)


def _int4_from_q4_k(raw: np.ndarray, shape: list[int]) -> Int4Weight:
    n, k = shape
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(-1, 144))  # host: file bytes
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    dmin = blocks[:, 2:4].contiguous().view(torch.float16).float()
    sc, mins = k_scales(blocks[:, 4:16])
    scales = (d * sc.float()).reshape(n, k // 32)
    neg_mins = -(dmin * mins.float()).reshape(n, k // 32)
    q = shifted(blocks[:, 16:], 32, [0, 4], 0x0F).reshape(n, k)  # groups of 32 in order
    return Int4Weight(_pack_nibbles(q), scales.contiguous(), neg_mins.contiguous(), 32)


def stack_rows(parts: list) -> torch.Tensor | QuantizedWeight:
    """Fuse weights along the output dimension (q|k|v, gate|up), dense or quantized alike."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, Int8Weight):
        return Int8Weight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]))
    if any(p.group_size != first.group_size for p in parts):
        raise ValueError("cannot fuse int4 weights of different group sizes")
    return Int4Weight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]),
                      torch.cat([p.mins for p in parts]), first.group_size)


def permute_rows(w, order: torch.Tensor):
    """``w`` with its output rows reordered (dense or quantized)."""
    if isinstance(w, torch.Tensor):
        return w[order]
    if isinstance(w, Int8Weight):
        return Int8Weight(w.qweight[order].contiguous(), w.scales[order].contiguous())
    return Int4Weight(w.qweight[order].contiguous(), w.scales[order].contiguous(), w.mins[order].contiguous(),
                      w.group_size)

