"""Encoders for GGUF's Q4_K and Q6_K blocks (gguf.quants only decodes K-quants): plain round to
nearest with one scale per group, not llama.cpp's search, but valid blocks any reader decodes."""

import numpy as np

QK_K = 256


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """``[rows, k]`` float32 -> ``[rows, k // 256 * 144]`` uint8 Q4_K blocks."""
    rows = w.shape[0]
    x = w.reshape(-1, 8, 32).astype(np.float32)
    low = np.minimum(x.min(axis=-1), 0)
    scale = (x.max(axis=-1) - low) / 15
    d = _fp16(scale.max(axis=-1) / 63)
    dmin = _fp16((-low).max(axis=-1) / 63)
    sc = np.clip(np.round(scale / np.maximum(d.astype(np.float32), 1e-30)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-low / np.maximum(dmin.astype(np.float32), 1e-30)[:, None]), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * m
    q = np.clip(np.round((x + offset[..., None]) / np.maximum(step, 1e-30)[..., None]), 0, 15).astype(np.uint8)
    packed = np.empty((x.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # groups 2i (low) and 2i + 1 (high) share bytes
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, qs], axis=1)
    return blocks.reshape(rows, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """``[rows, k]`` float32 -> ``[rows, k // 256 * 210]`` uint8 Q6_K blocks."""
    rows = w.shape[0]
    x = w.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(x).max(axis=-1) / 31
    d = _fp16(scale.max(axis=-1) / 127)
    sc = np.clip(np.round(scale / np.maximum(d.astype(np.float32), 1e-30)[:, None]), -128, 127).astype(np.int8)
    step = d.astype(np.float32)[:, None] * sc
    q = (np.clip(np.round(x / np.maximum(step, 1e-30)[..., None]), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)
    # Weight h * 128 + r: its low 4 bits in ql[h * 64 + r % 64] (high nibble when r >= 64), its high
    # 2 bits in qh[h * 32 + r % 32] at bit 2 * (r // 32).
    ql = (q[:, :, :64] & 0x0F) | ((q[:, :, 64:] & 0x0F) << 4)
    high = q >> 4
    qh = high[:, :, 0:32] | (high[:, :, 32:64] << 2) | (high[:, :, 64:96] << 4) | (high[:, :, 96:128] << 6)
    blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8),
                             d.view(np.uint8).reshape(-1, 2)], axis=1)
    return blocks.reshape(rows, -1)
