"""Hugging Face tensors under the names (and conventions) the GGUF reader also gives: Llama's.

Most architectures already use Llama's names (Gemma 1 too). Gemma 2/3 differ: their ``post_attention_layernorm``
normalises the attention output (ours: ``attn_output_norm``), ``pre_feedforward_layernorm`` is the
MLP's input norm (Llama's ``post_attention_layernorm``), and every Gemma norm multiplies by ``1 + w``,
which llama.cpp's GGUF files store with the 1 already added; so do we. Gemma 3's multimodal
checkpoints keep the text model under ``language_model.``: we load it, not the vision tower.
"""

import torch

from gpushare.catalog.model_config import ModelConfig

_GEMMA_NORMS = {
    ".post_attention_layernorm.": ".attn_output_norm.",
    ".pre_feedforward_layernorm.": ".post_attention_layernorm.",
    ".post_feedforward_layernorm.": ".mlp_output_norm.",
}
_TEXT_MODEL_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                         "language_model.lm_head.": "lm_head.",
                         # a bare *Model saved without its LM head (Qwen3-Embedding): its lm_head is the embedding
                         "layers.": "model.layers.", "embed_tokens.": "model.embed_tokens.", "norm.": "model.norm."}
_NOT_TEXT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def text_model_name(name: str) -> str | None:
    """The tensor's name in the text model, or None for one it does not use (a vision tower)."""
    if name.startswith(_NOT_TEXT):
        return None
    for theirs, ours in _TEXT_MODEL_PREFIXES.items():
        if name.startswith(theirs):
            return ours + name.removeprefix(theirs)
    return name


def hf_tensor(name: str, tensor: torch.Tensor, config: ModelConfig) -> tuple[str, torch.Tensor]:
    """``(name, tensor)`` as the GGUF reader would give them for this architecture."""
    if not config.arch.startswith("gemma"):
        return name, tensor
    for theirs, ours in _GEMMA_NORMS.items() if config.sandwich_norm else ():
        if theirs in name:
            name = name.replace(theirs, ours)
            break
    if name.endswith("norm.weight"):
        tensor = tensor + 1
    return name, tensor
