"""Rotary position embeddings: the inverse frequencies of every scaling a supported checkpoint uses
(linear, llama3, LongRoPE), the cos/sin table a model keeps per position, and the rotation itself."""

import math

import torch

from gpushare.catalog.model_config import ROPE_TYPES, ModelConfig, longrope_attention_factor, rope_type


def rope_inv_freq(config: ModelConfig, local: bool = False, long: bool = False) -> torch.Tensor:
    """Inverse frequencies of the global layers' RoPE, or (``local``) the sliding layers' own unscaled
    one; ``long`` picks LongRoPE's factors for positions past the original context."""
    dim = config.head_dim
    theta = config.rope_theta_local if local else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))  # host: at load
    scaling = {} if local else config.rope_scaling
    kind = rope_type(scaling)
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    elif kind == "longrope":
        name = "long_factor" if long else "short_factor"
        factors = torch.as_tensor(scaling.get(name) or [], dtype=torch.float64).flatten()  # host: at load
        if factors.numel() != dim // 2:
            raise ValueError(f"longrope {name} has {factors.numel()} entries, the head needs {dim // 2}")
        inv_freq = inv_freq / factors
    elif kind != "default":
        raise ValueError(f"unsupported rope scaling {kind!r} (supported: {', '.join(ROPE_TYPES)})")
    return inv_freq


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
    angles = torch.outer(positions.double(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return (torch.stack([angles.cos(), angles.sin()], dim=1) * factor).float()


def rope_table(config: ModelConfig, rope_freqs: torch.Tensor | None = None, local: bool = False) -> torch.Tensor:
    """cos and sin for every position, ``[context, 2, head_dim]`` float32.

    LongRoPE (Phi-3): positions within the original context use the short factors, later ones the
    long factors, all times its attention factor. transformers switches every position to the long
    factors once a sequence passes the original context, which a KV cache cannot follow without
    recomputing; up to the original context the two agree exactly.
    """
    positions = torch.arange(config.context_length)  # host: the table moves with the model
    if rope_type(config.rope_scaling) == "longrope" and not local:
        original = config.rope_scaling["original_max_position_embeddings"]
        factor = longrope_attention_factor(config.rope_scaling, config.context_length)
        return torch.cat([_cos_sin(positions[:original], rope_inv_freq(config), factor),
                          _cos_sin(positions[original:], rope_inv_freq(config, long=True), factor)])
    inv_freq = rope_inv_freq(config, local)
    if rope_freqs is not None and not local:  # GGUF's llama3 scaling ships the per-frequency divisors
        inv_freq = inv_freq / rope_freqs.double()
    return _cos_sin(positions, inv_freq)


def apply_rope(x, cos, sin):
    """Rotate-half RoPE; x: ``[T, H, D]``, cos/sin: ``[T, 1, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
