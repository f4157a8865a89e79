"""Torch dequantisation of GGUF block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants Q2_K to
Q6_K (the default downloads: Q4_K_M is Q4_K with some Q6_K), IQ4_NL and IQ4_XS.

Each decoder does the arithmetic of ``gguf.quants`` in the same order on the same float32 values,
so results are bit for bit equal (tests/test_dequant.py), and faster (1.4-2.5x with two threads,
docs/benchmarks.md; torch uses every thread, numpy one): every cold load pays it. Other formats fall
back to ``gguf.quants``.
"""

import numpy as np
import torch

QK_K = 256  # weights per K-quant super-block
_IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _halves(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte ``start`` of every block, as float32 ``[N, 1]``."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def shifted(q: torch.Tensor, group: int, shifts: list[int], mask: int) -> torch.Tensor:
    """ggml's packing: each run of ``group`` bytes holds several groups of values, the ``i``-th at
    bit ``shifts[i]``; returns them in order, ``[N, -1]`` uint8."""
    n = q.shape[0]
    shift = torch.tensor(shifts, dtype=torch.uint8, device=q.device).view(1, 1, -1, 1)
    return ((q.reshape(n, -1, 1, group) >> shift) & mask).reshape(n, -1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    # ggml stores weight j in the low nibble of byte j and weight j + 16 in its high nibble.
    return torch.cat([qs & 0x0F, qs >> 4], dim=1).float()


def _bits(raw: torch.Tensor, count: int) -> torch.Tensor:
    """Bit ``i`` (little-endian over the bytes) for ``i < count``: ``[N, count]`` uint8."""
    i = torch.arange(count, device=raw.device)
    return (raw[:, i // 8] >> (i % 8).to(torch.uint8)) & 1


def _q4_0(blocks):
    return _halves(blocks, 0) * (_nibbles(blocks[:, 2:18]) - 8)


def _q4_1(blocks):
    return _halves(blocks, 0) * _nibbles(blocks[:, 4:20]) + _halves(blocks, 2)


def _q5(blocks, head: int):
    low = shifted(blocks[:, head + 4:], 16, [0, 4], 0x0F)
    return low | (_bits(blocks[:, head:head + 4], 32) << 4)


def _q5_0(blocks):
    return _halves(blocks, 0) * (_q5(blocks, 2).to(torch.int8) - 16).float()


def _q5_1(blocks):
    return _halves(blocks, 0) * _q5(blocks, 4).float() + _halves(blocks, 2)


def _q8_0(blocks):
    return _halves(blocks, 0) * blocks[:, 2:34].contiguous().view(torch.int8).float()


def _q2_k(blocks):
    n = blocks.shape[0]
    scales, qs = blocks[:, :16], blocks[:, 16:80]
    dl = (_halves(blocks, 80) * (scales & 0x0F).float()).view(n, 16, 1)
    ml = (_halves(blocks, 82) * (scales >> 4).float()).view(n, 16, 1)
    q = shifted(qs, 32, [0, 2, 4, 6], 3).view(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(blocks):
    n = blocks.shape[0]
    hmask, qs, packed = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
    low = shifted(packed[:, :8], 8, [0, 4], 0x0F)
    high = shifted(packed[:, 8:], 4, [0, 2, 4, 6], 0x03)
    scales = ((low | (high << 4)).to(torch.int8) - 32).float()
    dl = (_halves(blocks, 108) * scales).view(n, 16, 1)
    ql = shifted(qs, 32, [0, 2, 4, 6], 3).view(n, 16, 16)
    qh = shifted(hmask, 32, list(range(8)), 1).view(n, 16, 16) ^ 1  # the offset applies when the bit is 0
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
    return (dl * q).reshape(n, QK_K)


def k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: eight 6-bit scales and eight 6-bit mins from 12 bytes."""
    d, m, m_d = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mins = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mins


def _q45_k(blocks, q: torch.Tensor):
    n = blocks.shape[0]
    sc, mins = k_scales(blocks[:, 4:16])
    d = (_halves(blocks, 0) * sc.float()).view(n, -1, 1)
    dm = (_halves(blocks, 2) * mins.float()).view(n, -1, 1)
    return (d * q.view(n, -1, 32).float() - dm).reshape(n, QK_K)


def _q4_k(blocks):
    return _q45_k(blocks, shifted(blocks[:, 16:], 32, [0, 4], 0x0F))


def _q5_k(blocks):
    low = shifted(blocks[:, 48:], 32, [0, 4], 0x0F)
    high = shifted(blocks[:, 16:48], 32, list(range(8)), 1)
    return _q45_k(blocks, low | (high << 4))


def _q6_k(blocks):
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = (_halves(blocks, 208) * scales).view(n, 16, 1)
    low = shifted(ql, 64, [0, 4], 0x0F)
    high = shifted(qh, 32, [0, 2, 4, 6], 0x03)
    q = ((low | (high << 4)).to(torch.int8) - 32).view(n, 16, 16).float()
    return (d * q).reshape(n, QK_K)


def _iq4_nl(blocks):
    values = torch.tensor(_IQ4_VALUES, dtype=torch.float32, device=blocks.device)
    return _halves(blocks, 0) * values[shifted(blocks[:, 2:], 16, [0, 4], 0x0F).long()]


def _iq4_xs(blocks):
    n = blocks.shape[0]
    low = shifted(blocks[:, 4:8], 1, [0, 4], 0x0F)  # sub-block i: nibble i % 2 of byte i // 2
    i = torch.arange(8, device=blocks.device)
    high = (blocks[:, 2 + i // 4] >> (2 * (i % 4)).to(torch.uint8)) & 3
    scales = ((low | (high << 4)).to(torch.int8) - 32).float()
    dl = (_halves(blocks, 0) * scales).view(n, 8, 1)
    values = torch.tensor(_IQ4_VALUES, dtype=torch.float32, device=blocks.device)
    q = values[shifted(blocks[:, 8:], 16, [0, 4], 0x0F).long()].view(n, 8, 32)
    return (dl * q).reshape(n, QK_K)


# type name -> (weights per block, bytes per block, how to turn [N, bytes] uint8 blocks into [N, weights] floats)
FAST = {"Q4_0": (32, 18, _q4_0), "Q4_1": (32, 20, _q4_1), "Q5_0": (32, 22, _q5_0), "Q5_1": (32, 24, _q5_1),
        "Q8_0": (32, 34, _q8_0), "Q2_K": (QK_K, 84, _q2_k), "Q3_K": (QK_K, 110, _q3_k), "Q4_K": (QK_K, 144, _q4_k),
        "Q5_K": (QK_K, 176, _q5_k), "Q6_K": (QK_K, 210, _q6_k), "IQ4_NL": (32, 18, _iq4_nl),
        "IQ4_XS": (QK_K, 136, _iq4_xs)}


# Byte offsets of each format's fp16 fields (scales, mins) in a block: what tests and benchmarks
# must fill with finite values when they make random blocks.
FP16_OFFSETS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82],
                "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_NL": [0], "IQ4_XS": [0]}
# Weights decoded at a time: 2 MiB of float32, so temporaries stay in cache and are reused. Measured
# on 32 MiB of blocks with 2 threads: 1.3-1.6x gguf.quants' numpy at 512k, slower again at 8M.
CHUNK_WEIGHTS = 1 << 19


def dequantize(raw: np.ndarray, type_name: str, shape: list[int]) -> torch.Tensor | None:
    """float32 tensor of ``shape`` from the raw block bytes, or None if this format has no fast path.

    Decoded in chunks into one output tensor: whole-tensor temporaries would each be fresh memory,
    and first-touching it costs more than the arithmetic (measured 5x on a uint8 -> float32 pass).
    """
    if type_name not in FAST:
        return None
    block_weights, block_bytes, decode = FAST[type_name]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, block_bytes)
    out = torch.empty(shape, dtype=torch.float32)  # host: decoded from the file's bytes
    flat = out.view(blocks.shape[0], block_weights)
    step = max(1, CHUNK_WEIGHTS // block_weights)
    for start in range(0, blocks.shape[0], step):
        # own, writable copy of the chunk: the file's memory map is read-only
        flat[start:start + step] = decode(torch.from_numpy(np.array(blocks[start:start + step])))  # host: file bytes
    return out
