"""Hugging Face tensors under the names (and conventions) the GGUF reader also gives: Llama's.

Most architectures already use Llama's names. Gemma 2/3 differ: their ``post_attention_layernorm``
normalises the attention output (ours: ``attn_output_norm``), ``pre_feedforward_layernorm`` is the
MLP's input norm (Llama's ``post_attention_layernorm``), and every norm multiplies by ``1 + w``,
which llama.cpp's GGUF files store with the 1 already added; so do we.
"""

import torch

from gpushare.models.config import ModelConfig

_GEMMA_NORMS = {
    ".post_attention_layernorm.": ".attn_output_norm.",
    ".pre_feedforward_layernorm.": ".post_attention_layernorm.",
    ".post_feedforward_layernorm.": ".mlp_output_norm.",
}


def hf_tensor(name: str, tensor: torch.Tensor, config: ModelConfig) -> tuple[str, torch.Tensor]:
    """``(name, tensor)`` as the GGUF reader would give them for this architecture."""
    if not config.arch.startswith("gemma"):
        return name, tensor
    for theirs, ours in _GEMMA_NORMS.items():
        if theirs in name:
            name = name.replace(theirs, ours)
            break
    if name.endswith("norm.weight"):
        tensor = tensor + 1
    return name, tensor
