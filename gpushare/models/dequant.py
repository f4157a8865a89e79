"""Fast torch dequantisation of the common GGUF block formats (Q4_0, Q4_1, Q8_0).

gguf's numpy reference does the same arithmetic about 4x slower on this model; load time
matters because every cold load pays it. Other formats fall back to ``gguf.quants``.
"""

import numpy as np
import torch

# type name -> (bytes per block of 32 weights, how to turn [N, bytes] uint8 blocks into [N, 32] floats)
BLOCK = 32


def _halves(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    # ggml stores weight j in the low nibble of byte j and weight j + 16 in its high nibble.
    return torch.cat([qs & 0x0F, qs >> 4], dim=1).float()


def _q4_0(blocks):
    return _halves(blocks, 0) * (_nibbles(blocks[:, 2:18]) - 8)


def _q4_1(blocks):
    return _halves(blocks, 0) * _nibbles(blocks[:, 4:20]) + _halves(blocks, 2)


def _q8_0(blocks):
    return _halves(blocks, 0) * blocks[:, 2:34].contiguous().view(torch.int8).float()


FAST = {"Q4_0": (18, _q4_0), "Q4_1": (20, _q4_1), "Q8_0": (34, _q8_0)}


def dequantize(raw: np.ndarray, type_name: str, shape: list[int]) -> torch.Tensor | None:
    """float32 tensor of ``shape`` from the raw block bytes, or None if this format has no fast path."""
    if type_name not in FAST:
        return None
    block_bytes, decode = FAST[type_name]
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(-1, block_bytes))  # own, writable copy
    return decode(blocks).reshape(shape)
