"""Weight-only quantized matmul in plain torch: the CPU path and the reference for the Triton kernels.

``y = x @ w.T`` where ``w [N, K]`` is stored quantized. Layouts (shared with the Triton kernels
and produced by the model loader):

- int8, per output channel: ``qweight`` int8 ``[N, K]``, ``scales`` float32 ``[N]``;
  ``w[n, k] = qweight[n, k] * scales[n]``.
- int4, group-wise asymmetric (like GGUF Q4_1): ``qweight`` uint8 ``[N, K // 2]``, byte ``j`` of
  row ``n`` holds ``k = 2j`` in its low nibble and ``k = 2j + 1`` in its high nibble (0..15);
  ``scales`` and ``mins`` float32 ``[N, K // group_size]``;
  ``w[n, k] = q[n, k] * scales[n, k // group_size] + mins[n, k // group_size]``.

The dequantised weight is computed in float32 and rounded once to the activation dtype, which is
also what the Triton kernels feed their dots; the matmul then runs in that dtype.
"""

import torch
import torch.nn.functional as F


def dequantize_int8(qweight, scales, dtype=torch.float32):
    """``[N, K]`` weight in ``dtype`` from int8 ``qweight [N, K]`` and per-row ``scales [N]``."""
    return (qweight.to(torch.float32) * scales[:, None]).to(dtype)


def unpack_int4(qweight):
    """Nibbles of uint8 ``qweight [N, K // 2]`` as uint8 ``[N, K]`` (low nibble first)."""
    return torch.stack((qweight & 0xF, qweight >> 4), dim=-1).view(qweight.shape[0], -1)


def dequantize_int4(qweight, scales, mins, group_size, dtype=torch.float32):
    """``[N, K]`` weight in ``dtype`` from packed nibbles and per-group ``scales``/``mins [N, K // group_size]``."""
    rows, num_groups = scales.shape
    q = unpack_int4(qweight).view(rows, num_groups, group_size).to(torch.float32)
    return (q * scales[..., None] + mins[..., None]).view(rows, -1).to(dtype)


def int8_weight_matmul(x, qweight, scales):
    """``x [..., K]`` times the int8 weight ``[N, K]`` transposed: ``[..., N]`` in ``x.dtype``."""
    return F.linear(x, dequantize_int8(qweight, scales, x.dtype))


def int4_weight_matmul(x, qweight, scales, mins, group_size):
    """``x [..., K]`` times the int4 weight ``[N, K]`` transposed: ``[..., N]`` in ``x.dtype``."""
    return F.linear(x, dequantize_int4(qweight, scales, mins, group_size, x.dtype))
